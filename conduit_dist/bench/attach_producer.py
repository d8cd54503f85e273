"""``bench attach``'s producer, a process outside the job: ``python -m
conduit_dist.bench.attach_producer RUN_DIR ID INGRESS START COUNT INTERVAL_S SIZE MEDIAN``.

Attaches to the plane's ingress ``INGRESS`` and prints ``{"producer", "attach_t0",
"first_gid"}`` (``attach_t0``: ``time.monotonic()`` before the attach, one clock for every process
of the host), then puts groups ``START, START+1, ...`` of ``SIZE`` responses (``bench tokens``'
lognormal lengths), one every ``INTERVAL_S``: ``COUNT`` of them, then flushes and closes; with
``COUNT`` 0 until SIGTERM, then flushes and closes."""

from __future__ import annotations

import json
import signal
import sys
import time

import numpy as np

import conduit_dist as cd
from conduit_dist.bench.token_baselines import Data


def main(argv: list[str]) -> None:
    run_dir, pid, ingress = argv[0], argv[1], int(argv[2])
    start, count, interval = int(argv[3]), int(argv[4]), float(argv[5])
    size, median = int(argv[6]), float(argv[7])
    if len(argv) > 8 and argv[8] == "1":
        print(json.dumps({"standby": pid}), flush=True)
        sys.stdin.readline()  # standby until told to go
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    rng = np.random.default_rng(start)
    t0 = time.monotonic()
    p = cd.attach(run_dir, "tokens", producer=pid, ingress=ingress, timeout_s=60)
    print(json.dumps({"producer": pid, "attach_t0": t0, "attach_s": time.monotonic() - t0,
                      "first_gid": start}), flush=True)  # fmt: skip
    g = start
    try:
        while not stop and (count == 0 or g < start + count):
            batch, lengths = Data(rng, 1, size, median, g).batch()
            p.put(batch, lengths)
            g += 1
            time.sleep(interval)
        p.close()
    except cd.RoundError:  # the plane closed first: what it acknowledged is counted there
        pass
    print(json.dumps({"producer": pid, "put": g - start}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
