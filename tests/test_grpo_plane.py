"""The update the token plane feeds is the reference update: a fixed set of prompt groups put
into a ``TokenPlane`` on 2 gloo ranks (each producing half), taken by both learners as
micro-batches (``fetch``, then ``stream``) and trained with the gradient all-reduce, leaves the
parameters one process reaches with the same groups and no plane (``rl/grpo_update.py`` over
``split_micro_batches``). A plane that dropped, duplicated or altered a group would change the
gradient; SGD keeps its scale visible (Adam's first steps would hide a factor)."""

from __future__ import annotations

import numpy as np
import torch
from dist_utils import run_ranks

from conduit_dist.rl.grpo import (
    VOCAB,
    GRPOConfig,
    make_prompts,
    sample_groups,
    split_micro_batches,
    to_token_batch,
    token_spec,
)
from conduit_dist.rl.grpo_update import GRPOUpdate
from conduit_dist.rl.lm import LMConfig, TinyLM

CFG = GRPOConfig(max_digits=4, max_new=6, group_size=4, prompts_per_step=6)
STEPS = 2  # global batches: the second trains off-policy (ratios away from 1, some clipped)
BUDGET = 60  # tokens per micro-batch: several per learner


def _policy() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(LMConfig(vocab=VOCAB, d_model=32, max_len=CFG.max_digits + 1 + CFG.max_new))


def _step_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The fixed groups of a global batch, ids ``100 * step + g``: sampled from the initial
    policy, each response token given a random advantage (an untrained policy's rewards are
    mostly 0, which would leave nothing to compare)."""
    prompts = make_prompts(CFG.prompts_per_step, np.random.default_rng(step), CFG.max_digits)
    gen = torch.Generator().manual_seed(step)
    groups = sample_groups(_policy(), prompts, CFG.group_size, CFG.max_new, gen)
    ids = [100 * step + g for g in range(len(groups))]
    batch, lengths = to_token_batch(groups, ids)
    adv = torch.randn(len(batch["advantage"]), generator=torch.Generator().manual_seed(step))
    batch["advantage"] = adv * batch["loss_mask"]
    return batch, lengths


def _select(batch, lengths, keep: list[int]):
    """The sequences ``keep`` of a packed batch, packed."""
    (fields, cu, _), *rest = split_micro_batches(batch, lengths, 1 << 30, torch.tensor(keep))
    assert not rest
    return fields, cu.diff().long()


def _plane_learner(rank: int, world: int) -> dict[str, object]:  # pragma: no cover - a rank
    import torch.distributed as dist

    import conduit_dist as cd

    policy = _policy()
    update = GRPOUpdate(policy, CFG, dist.group.WORLD)
    update.opt = torch.optim.SGD(update.params, lr=0.5)
    seqs = 2 * CFG.prompts_per_step * CFG.group_size
    taken: list[int] = []
    with cd.TokenPlane(token_spec(CFG), seqs, seqs * 16, seed=rank) as plane:
        for step in range(STEPS):
            batch, lengths = _step_batch(step)
            g = CFG.group_size
            mine = [i for i in range(len(lengths)) if (i // g) % world == rank]
            plane.put(*_select(batch, lengths, mine))  # this producer's half of the groups
            take = plane.fetch if step == 0 else plane.stream
            for mb in take(CFG.prompts_per_step, BUDGET):
                assert int(mb.cu_seqlens[-1]) <= BUDGET
                taken.extend(mb["group"].tolist())
                update.accumulate(mb.fields, mb.cu_seqlens, mb.max_seqlen)
            update.step()
    params = [p.detach().numpy().copy() for p in policy.parameters()]
    return {"params": params, "taken": taken}


def _reference() -> list[torch.Tensor]:
    policy = _policy()
    update = GRPOUpdate(policy, CFG)
    update.opt = torch.optim.SGD(update.params, lr=0.5)
    for step in range(STEPS):
        batch, lengths = _step_batch(step)
        for fields, cu, width in split_micro_batches(batch, lengths, 1 << 30):
            update.accumulate(fields, cu, width)
        update.step()
    return [p.detach() for p in policy.parameters()]


def test_plane_fed_update_on_two_learners_equals_the_reference_update():
    got = run_ranks(_plane_learner, 2, timeout_s=120)
    taken = sorted(got[0]["taken"] + got[1]["taken"])
    every = [100 * s + g for s in range(STEPS) for g in range(CFG.prompts_per_step)]
    assert taken == sorted(i for i in every for _ in range(CFG.group_size))  # each group once
    assert got[0]["taken"] and got[1]["taken"]  # both learners trained
    ref = _reference()
    start = [p.detach() for p in _policy().parameters()]
    moved = sum(float((r - p).abs().max()) for r, p in zip(ref, start))
    assert moved > 0.1  # the steps changed the weights: the comparison can see a difference
    for rank in (0, 1):
        for a, b in zip(got[rank]["params"], ref, strict=True):
            torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-5, atol=1e-6)
