"""Launched by test_collectives under torchrun: an optimizer built and stepped after
``init_distributed`` (torch imports torch._dynamo when it is built, lazily), one collective, then
``destroy_distributed``; writes how many gloo worker threads are left on this rank to
``rank<N>.json`` in the working directory (a file each: the ranks' stdout lines interleave)."""

import json
import os

import torch
import torch.distributed as dist

import conduit_dist as cd


def gloo_workers() -> int:
    """This process's threads that gloo process groups run their work on."""
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in tasks)


cd.init_distributed()
net = torch.nn.Linear(4, 2)
opt = torch.optim.Adam(net.parameters())
net(torch.ones(3, 4)).sum().backward()
opt.step()
ranks = [None] * dist.get_world_size()
dist.all_gather_object(ranks, dist.get_rank())
rank = dist.get_rank()
cd.destroy_distributed()
with open(f"rank{rank}.json", "w") as f:
    json.dump({"rank": rank, "gloo_workers": gloo_workers()}, f)
