"""Run by test_multihost.py on each rank of each emulated host: discover, run rounds under each
placement named on the command line, write one JSON file per rank into the given directory.

Usage: ``torchrun ... multihost_plane_prog.py OUT_DIR PLACEMENT [PLACEMENT ...]``
"""

import json
import socket
import sys
from pathlib import Path

import torch
from plane_helpers import assert_intact, make_batch, shard_items, spec

import conduit_dist as cd

ROUNDS, PUT, FETCH = 4, 32, 16


def run(placement: str, rank: int) -> dict:
    """Every rank puts and fetches (colocated); bytes sent over each link class, summed from the
    plane's round stats, and the items put and held (every item must land exactly once)."""
    plane = cd.DataPlane(spec(), 400, seed=2, schedule="sync", placement=placement)
    links = plane.topology.link_matrix()[rank]  # this rank's link class to every rank
    sent = torch.zeros(3, dtype=torch.int64)  # bytes to self, same host, other host
    put, strategies = [], []
    for it in range(ROUNDS):
        ids = rank * 10_000 + it * 100 + torch.arange(PUT)
        plane.put(make_batch(ids))
        put += ids.tolist()
        assert_intact(plane.fetch(FETCH))
        st = plane.stats
        if st.sent is not None:
            sent += torch.bincount(torch.from_numpy(links), torch.from_numpy(st.sent), 3).long()
        strategies += [m.strategy for m in st.moves]
    plane.flush()  # ingest what the last fetch's round left staged
    out = {
        "hosts": list(plane.topology.hosts),
        "host_of": list(plane.topology.host_of),
        "links": plane.topology.link_matrix().tolist(),
        "sent": dict(zip(("self", "host", "net"), sent.tolist(), strict=True)),
        "put": put,
        "held": shard_items(plane).tolist(),
        "strategies": strategies,
        "shared_memory": plane._p.exchange.shm is not None,  # auto: off across hosts
    }
    plane.close()
    return out


def main() -> None:
    out_dir, placements = Path(sys.argv[1]), sys.argv[2:]
    cd.init_distributed(timeout_s=60)
    rank = cd.get_rank()
    result = {"rank": rank, "hostname": socket.gethostname()}
    result.update({p: run(p, rank) for p in placements})
    cd.destroy_distributed()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
