"""GRPO core: packed log-probs, the task's reward, advantages, the loss, the batch format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conduit_dist.rl.grpo import (
    EOS,
    FIXED,
    RAGGED,
    SEP,
    VOCAB,
    GRPOConfig,
    group_advantages,
    grpo_loss,
    make_prompts,
    micro_batch_loss,
    reward,
    sample_groups,
    split_micro_batches,
    to_token_batch,
    token_spec,
)
from conduit_dist.rl.grpo_eval import PromptSplit, evaluate, greedy_rewards
from conduit_dist.rl.lm import LMConfig, TinyLM, generate, packed_logprobs
from conduit_dist.tokens import MicroBatch
from conduit_dist.tokens.spec import check_batch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(seed: int = 0, scale: float = 0.3, d_model: int = 32) -> TinyLM:
    """A policy whose random weights give non-uniform predictions."""
    torch.manual_seed(seed)
    m = TinyLM(LMConfig(vocab=VOCAB, d_model=d_model, max_len=32))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, scale)
    return m


def _per_sequence(m: TinyLM, seqs: list[torch.Tensor]) -> torch.Tensor:
    out = []
    for s in seqs:
        logp = torch.log_softmax(m(s.long()[None])[0, :-1], -1)
        out += [torch.zeros(1), logp.gather(-1, s.long()[1:, None]).squeeze(-1)]
    return torch.cat(out)


@pytest.mark.parametrize("mode", ["pad", "mask"])
def test_packed_logprobs_equal_per_sequence(mode):
    m = _model()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (int(n),), generator=g) for n in [1, 5, 17, 2, 9, 30]]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    packed = packed_logprobs(m, torch.cat(seqs).to(torch.int32), cu, mode=mode)
    torch.testing.assert_close(packed, _per_sequence(m, seqs), atol=1e-5, rtol=1e-5)


def test_generate_behaviour_logprobs_match_packed():
    m = _model(seed=2)
    prompts = make_prompts(24, np.random.default_rng(0), max_digits=6)
    tok, logp, lengths = generate(m, prompts, 8, EOS, generator=torch.Generator().manual_seed(0))
    seqs = [p + tok[i, : lengths[i]].tolist() for i, p in enumerate(prompts)]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    packed = packed_logprobs(m, torch.tensor([t for s in seqs for t in s]), cu)
    for i, p in enumerate(prompts):
        resp = packed[cu[i] + len(p) : cu[i + 1]]
        torch.testing.assert_close(resp, logp[i, : lengths[i]], atol=1e-5, rtol=1e-5)
    assert ((tok == EOS).any(1) | (lengths == 8)).all()
    assert (logp[torch.arange(8)[None] >= lengths[:, None]] == 0).all()


def test_reward_partial_credit():
    p = [1, 2, 3, SEP]  # answer 3 2 1
    assert reward(p, [3, 2, 1, EOS]) == 1.0
    assert reward(p, [3, 0, 1, EOS]) == pytest.approx(2 / 3)
    assert reward(p, [3, 2, EOS]) == pytest.approx(2 / 3)
    assert reward(p, [3, 2, 1, 5, EOS]) == pytest.approx(3 / 4)
    assert reward(p, [EOS]) == 0.0
    assert reward(p, [3, 2, 1]) == 0.0  # no EOS: malformed
    assert reward(p, [3, SEP, 1, EOS]) == 0.0  # a non-digit: malformed
    with pytest.raises(ValueError):
        reward([1, 2], [EOS])


def test_make_prompts_lengths():
    ps = make_prompts(500, np.random.default_rng(0), max_digits=7)
    lens = {len(p) - 1 for p in ps}
    assert lens == set(range(1, 8))
    assert all(p[-1] == SEP and max(p[:-1]) <= 9 for p in ps)


def test_group_advantages_normalised():
    r = torch.tensor([[0.0, 1.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2], [1.0, 0.0, 0.0, 0.0]])
    a = group_advantages(r, eps=0.0 + 1e-8)
    torch.testing.assert_close(a.mean(1), torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(a[[0, 2]].std(1, unbiased=False), torch.ones(2))
    assert (a[1] == 0).all()


def _batch(cfg: GRPOConfig, seed: int = 0):
    m = _model(seed=seed, d_model=32)
    prompts = make_prompts(cfg.prompts_per_step, np.random.default_rng(seed), cfg.max_digits)
    gen = torch.Generator().manual_seed(seed)
    groups = sample_groups(m, prompts, cfg.group_size, cfg.max_new, gen)
    return m, groups, *to_token_batch(groups, [10 + i for i in range(len(groups))])


def test_batch_format_round_trips():
    cfg = GRPOConfig(group_size=4, prompts_per_step=5)
    _, groups, batch, lengths = _batch(cfg)
    assert set(batch) == set(RAGGED) | set(FIXED)
    assert lengths.sum() == batch["tokens"].shape[0] and len(lengths) == 20
    dtypes = {"tokens": torch.int32, "logprobs": torch.float32, "loss_mask": torch.bool}
    assert all(batch[k].dtype == d for k, d in dtypes.items())
    assert batch["reward"].dtype == torch.float32 and batch["group"].dtype == torch.int64
    packed = check_batch(token_spec(cfg), batch, lengths, version=0)  # the plane accepts it
    assert packed.n == 20
    adv = group_advantages(torch.stack([g.rewards for g in groups]))
    seen = 0
    for fields, cu, max_len in split_micro_batches(batch, lengths, 40, torch.randperm(20)):
        assert int(cu[-1]) <= 40 or len(cu) == 2
        assert max_len == int(cu.diff().max())
        for j in range(len(cu) - 1):
            sl = slice(int(cu[j]), int(cu[j + 1]))
            gi = int(fields["group"][j]) - 10
            g = groups[gi]
            resp = fields["tokens"][sl][fields["loss_mask"][sl]].tolist()
            k = g.responses.index(resp)
            assert fields["tokens"][sl].tolist() == g.prompt + resp
            torch.testing.assert_close(fields["logprobs"][sl][len(g.prompt) :], g.logprobs[k])
            assert (fields["logprobs"][sl][: len(g.prompt)] == 0).all()
            adv_tok = fields["advantage"][sl][fields["loss_mask"][sl]]
            torch.testing.assert_close(adv_tok, adv[gi, k].expand(len(resp)))
            assert (fields["advantage"][sl][: len(g.prompt)] == 0).all()
            assert float(fields["reward"][j]) == reward(g.prompt, resp)
            seen += 1
    assert seen == 20


def test_loss_gradient_only_through_response_tokens():
    cfg = GRPOConfig(group_size=4, prompts_per_step=4)
    _, _, batch, _ = _batch(cfg, seed=3)
    torch.manual_seed(0)
    mask = batch["loss_mask"]
    adv = torch.randn(mask.shape) * mask  # random rewards: the untrained policy scores ~0
    new = batch["logprobs"].clone() + 0.1 * torch.randn(mask.shape)
    new.requires_grad_(True)
    loss, stats = grpo_loss(new, batch["logprobs"], adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and 0 <= stats["clipfrac"] <= 1
    assert (new.grad[~mask] == 0).all()
    assert (new.grad[mask] != 0).float().mean() > 0.5  # clipped tokens have no gradient
    # prompt-token values do not matter
    junk, old = adv.clone(), batch["logprobs"].clone()
    junk[~mask], old[~mask] = 123.0, -7.0
    loss2, _ = grpo_loss(new, old, junk, mask)
    assert loss2.item() == pytest.approx(loss.item())


def test_micro_batch_loss_from_plane_micro_batch():
    cfg = GRPOConfig(group_size=4, prompts_per_step=4)
    m, _, batch, lengths = _batch(cfg, seed=4)
    (fields, cu, max_len), *_ = split_micro_batches(batch, lengths, 10_000)
    fields["advantage"] = torch.randn(fields["advantage"].shape) * fields["loss_mask"]
    mb = MicroBatch(fields, cu, max_len, (0, 1), RAGGED)
    loss, stats = micro_batch_loss(m, mb.fields, mb.cu_seqlens, mb.max_seqlen, cfg)
    loss.backward()
    assert torch.isfinite(loss)
    assert stats["ratio"] == pytest.approx(1.0, abs=1e-4)  # on-policy: behaviour == current
    assert sum(float(p.grad.abs().sum()) for p in m.parameters()) > 0


def test_kl_term_needs_reference():
    x = torch.zeros(3)
    with pytest.raises(ValueError):
        grpo_loss(x, x, x, x.bool(), kl_coef=0.1)
    loss, stats = grpo_loss(x, x, x, torch.ones(3, dtype=torch.bool), ref_logp=x, kl_coef=0.1)
    assert float(loss) == 0.0 and stats["kl"] == 0.0
    cfg = GRPOConfig(group_size=2, prompts_per_step=3, kl_coef=0.1)
    m, _, batch, lengths = _batch(cfg, seed=5)
    (fields, cu, max_len), *_ = split_micro_batches(batch, lengths, 10_000)
    with pytest.raises(ValueError):
        micro_batch_loss(m, fields, cu, max_len, cfg)
    _, same = micro_batch_loss(m, fields, cu, max_len, cfg, ref=m)
    _, other = micro_batch_loss(m, fields, cu, max_len, cfg, ref=_model(seed=6, d_model=32))
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and other["kl"] > 0.01


def test_training_raises_reward_on_one_digit_task():
    torch.manual_seed(0)
    cfg = GRPOConfig(max_digits=1, max_new=3, group_size=8, prompts_per_step=16, lr=3e-3)
    m = TinyLM(LMConfig(vocab=VOCAB, d_model=32, max_len=8))
    opt = torch.optim.Adam(m.parameters(), lr=cfg.lr)
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    means = []
    for _ in range(100):
        groups = sample_groups(m, make_prompts(16, rng, 1), 8, cfg.max_new, gen)
        means.append(float(torch.cat([g.rewards for g in groups]).mean()))
        batch, lengths = to_token_batch(groups)
        for fields, cu, max_len in split_micro_batches(batch, lengths, 10_000):
            loss, _ = micro_batch_loss(m, fields, cu, max_len, cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert np.mean(means[-10:]) > np.mean(means[:10]) + 0.2, means


def test_heldout_prompts_are_fixed_distinct_and_never_drawn_for_training():
    split = PromptSplit(256, max_digits=6, seed=1234)
    assert split.lengths == [3, 4, 5, 6]  # 1- and 2-digit prompts: too few to hold out
    assert len({tuple(p) for p in split.heldout}) == 256
    assert all(p[-1] == SEP and 3 <= len(p) - 1 <= 6 for p in split.heldout)
    lens = [len(p) - 1 for p in split.heldout]
    assert all(lens.count(k) == 64 for k in range(3, 7))
    assert split.heldout == PromptSplit(256, 6, 1234).heldout  # the seed fixes the set
    assert split.heldout != PromptSplit(256, 6, 99).heldout
    train = split.train(20_000, np.random.default_rng(0))
    assert not any(p in split for p in train)
    assert len({len(p) - 1 for p in train}) == 6  # training keeps every length
    # 1,000 3-digit strings: of 64 held out, some would have been drawn had they not been
    tiny = PromptSplit(90, max_digits=3, seed=0)  # 3-digit strings only: 90 of 1,000
    assert tiny.lengths == [3]
    assert not any(p in tiny for p in tiny.train(5000, np.random.default_rng(1)))
    with pytest.raises(ValueError, match="do not fit"):
        PromptSplit(1000, max_digits=2, seed=0)


def test_greedy_evaluation_scores_the_argmax_answer():
    m = _model(seed=7)
    prompts = make_prompts(40, np.random.default_rng(3), 4)
    tok, _, lengths = generate(m, prompts, 6, EOS, greedy=True)
    again, _, _ = generate(m, prompts, 6, EOS, generator=None, greedy=True)
    assert torch.equal(tok, again)  # deterministic
    for i, p in enumerate(prompts[:5]):  # each token is the argmax given what came before
        seq = p + tok[i, : lengths[i]].tolist()
        logits = m(torch.tensor(seq)[None])[0]
        for t in range(len(p), len(seq)):
            assert seq[t] == int(logits[t - 1].argmax())
    r = greedy_rewards(m, prompts, 6)
    want = [reward(p, tok[i, : lengths[i]].tolist()) for i, p in enumerate(prompts)]
    assert r.tolist() == want
    ev = evaluate(m, prompts, 6)
    assert ev == {"exact": float((r == 1).double().mean()), "reward": float(r.mean())}
