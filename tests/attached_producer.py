"""A producer outside the job, for the attach tests: ``python attached_producer.py RUN_DIR ID
INGRESS KIND START COUNT MODE [GROUP_SIZE]`` attaches to the plane's ingress ``INGRESS`` and puts
groups ``START .. START+COUNT-1`` (tokens: one group a put; rows: one row a put, ``id`` = the
group id), then flushes and prints one JSON line. ``MODE``: ``whole``, or ``partial`` (then half
of group ``START+COUNT`` too, prints ``{"ready": ...}`` once acknowledged and waits to be
killed), or ``resume`` (then 3 more once ``RUN_DIR/go2`` exists, and 2 more once ``go3``
exists: across a job that died and was restored in between), or ``stream`` (a group a put,
each flushed and logged ``{"acked": gid, "seq": ...}``, until killed)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from test_tokens import MAX_LEN, member  # the test's groups: content follows from the ids

import conduit_dist as cd

__all__ = ["MAX_LEN", "member"]


def group(gid: int, members: range):
    seqs = [member(gid, m) for m in members]
    batch = {k: torch.cat([s[k] for s in seqs]) for k in ("tokens", "logprobs", "loss_mask")}
    batch["reward"] = torch.stack([s["reward"] for s in seqs])
    batch["group"] = torch.full((len(seqs),), gid, dtype=torch.int64)
    return batch, torch.tensor([s["tokens"].shape[0] for s in seqs])


def row(gid: int) -> dict[str, torch.Tensor]:
    return {"id": torch.tensor([gid]), "obs": torch.full((1, 3), float(gid))}


def main() -> None:
    run_dir, pid, ingress, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    start, count, mode = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    size = int(sys.argv[8]) if len(sys.argv) > 8 else 4
    t0 = time.monotonic()
    p = cd.attach(run_dir, kind, producer=pid, ingress=ingress, timeout_s=30)
    attached = time.monotonic() - t0
    if mode == "stream":  # groups until killed, one acknowledged put each, logged by id
        g = start
        while True:
            p.put(*group(g, range(size)))
            p.flush()
            print(json.dumps({"acked": g, "seq": p._acked_hi, "attaches": p.attaches}),
                  flush=True)  # fmt: skip
            g += 1
            time.sleep(0.05)
    for g in range(start, start + count):
        if kind == "tokens":
            p.put(*group(g, range(size)))
        else:
            p.put(row(g))
        time.sleep(0.02)
    if mode == "resume":  # the job checkpoints, dies and comes back between the phases

        def wait_for(name: str) -> None:
            while not os.path.exists(os.path.join(run_dir, name)):
                time.sleep(0.05)

        p.flush()
        print(json.dumps({"phase": 1}), flush=True)
        wait_for("go2")
        for g in range(start + count, start + count + 3):
            p.put(*group(g, range(size)))
        p.flush()
        print(json.dumps({"phase": 2}), flush=True)
        wait_for("go3")
        for g in range(start + count + 3, start + count + 5):
            p.put(*group(g, range(size)))  # the first one reattaches, to the new job
        p.flush()
        print(json.dumps({"done": p.producer, "attaches": p.attaches, "resent": p.resent}),
              flush=True)  # fmt: skip
        p.close()
        return
    if mode == "partial":
        if kind == "tokens":
            p.put(*group(start + count, range(size // 2)))
        p.flush()
        print(json.dumps({"ready": p.producer, "acked": count}), flush=True)
        time.sleep(3600)
    p.flush()
    print(json.dumps({"done": p.producer, "acked": count, "attach_s": attached,
                      "resent": p.resent}), flush=True)  # fmt: skip
    p.close()


if __name__ == "__main__":
    main()
