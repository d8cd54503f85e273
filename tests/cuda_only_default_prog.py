"""Launched by test_groups under torchrun: the user's own default group has no CPU backend
(``init_process_group("cuda:gloo")`` here, ``"nccl"`` on a GPU machine), then a plane runs;
writes ``rank<N>.json`` in the working directory (a file each: the ranks' stdout interleaves)."""

import json
from datetime import timedelta

import torch
import torch.distributed as dist
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd
from conduit_dist.collectives.dist import plane_group
from conduit_dist.collectives.exchange import Exchange


def main() -> None:
    dist.init_process_group("cuda:gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    try:
        dist.all_reduce(torch.ones(1))
        default_cpu = "works"
    except RuntimeError as exc:  # what every CPU collective of a copied group would do
        default_cpu = str(exc).splitlines()[0]
    ex = Exchange(30.0, name="groups")
    backend = str(dist.get_backend(ex.group))
    ex.close()
    shared = plane_group(timedelta(seconds=30), torch.device("cuda", 0), "gloo")
    flag = torch.ones(1)
    dist.all_reduce(flag, group=shared)  # CPU tensors go to its gloo part
    shared_backend = str(dist.get_backend(shared))
    dist.destroy_process_group(shared)
    plane = cd.DataPlane(spec(), 100, seed=1, schedule="sync", placement="round_robin")
    plane.put(make_batch(rank * 100 + torch.arange(8)))
    assert_intact(plane.fetch(6))
    hosts = plane.topology.num_hosts
    plane.close()
    dist.destroy_process_group()
    out = {
        "default_cpu": default_cpu,
        "backend": backend,
        "shared_backend": shared_backend,
        "flag": int(flag.item()),
        "hosts": hosts,
    }
    with open(f"rank{rank}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
