"""Split ``bench store``'s small insert (put + flush at world size 1) into its two calls.

``bench store`` times ``plane.put(batch)`` + ``plane.flush()`` against a ring buffer's slice
copies. This probe times the two calls apart, on 256 items of the 525-byte transition in a store
of 100,000, beside the ring buffer's insert of the same batch, and prints the medians of 5 blocks
of 2,000 inserts (microseconds). Where the gap to the ring is; not a benchmark:

    PYTHONPATH=. python scripts/store_insert_split.py
"""

from __future__ import annotations

import statistics
import time

import torch

from conduit_dist.bench.store import ConduitStore, RingStore, make_batch


def main() -> None:
    """Fill both stores, time the blocks and print one line."""
    torch.set_num_threads(1)
    example = make_batch("small", 2)
    conduit, ring = ConduitStore(example, 100_000), RingStore(example, 100_000)
    batches = [make_batch("small", 256, seed=s) for s in range(2)]
    for i in range(500):
        conduit.insert(batches[i & 1])
        ring.insert(batches[i & 1])
    plane, clock = conduit.plane, time.perf_counter
    put, flush, rings = [], [], []
    for _ in range(5):
        t_put = t_flush = 0.0
        for i in range(2000):
            t0 = clock()
            plane.put(batches[i & 1])
            t1 = clock()
            plane.flush()
            t_put, t_flush = t_put + t1 - t0, t_flush + clock() - t1
        t0 = clock()
        for i in range(2000):
            ring.insert(batches[i & 1])
        rings.append((clock() - t0) / 2000 * 1e6)
        put.append(t_put / 2000 * 1e6)
        flush.append(t_flush / 2000 * 1e6)
    med = statistics.median
    print(
        f"put {med(put):.1f} us + flush {med(flush):.1f} us = "
        f"{med(put) + med(flush):.1f} us an insert; ring {med(rings):.1f} us"
    )
    conduit.close()


if __name__ == "__main__":
    main()
