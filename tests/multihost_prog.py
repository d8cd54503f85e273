"""Run by test_multihost.py on each emulated host: discover, exchange, print one JSON line."""

import json

import torch

import conduit_dist as cd


def main() -> None:
    cd.init_distributed(timeout_s=60)
    from plane_helpers import assert_intact, make_batch, shard_items, spec

    rank = cd.get_rank()
    plane = cd.DataPlane(spec(), 200, seed=2, schedule="sync")
    topo = plane.topology  # discovered by the plane at start-up
    put, strategies = [], []
    for it in range(3):
        ids = rank * 1000 + it * 100 + torch.arange(20)
        plane.put(make_batch(ids))
        put += ids.tolist()
        assert_intact(plane.fetch(16))
        strategies += [m.strategy for m in plane.stats.moves]
    plane.flush()
    out = {
        "rank": rank,
        "hosts": list(topo.hosts),
        "link": topo.link(0, 1),
        "put": put,
        "held": shard_items(plane).tolist(),
        "strategies": strategies,
    }
    plane.close()
    cd.destroy_distributed()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
