"""What a side of ``bench tokens --peer`` delivered, checked against what the producers put:
every group's members' bytes (``digests_equal``) and every group whole, in one micro-batch of one
learner, once (``groups_whole``). A micro-batch here is a dict of packed columns: each token
field ``[tokens]``, ``reward`` and ``group`` ``[sequences]`` and ``cu_seqlens``."""

from __future__ import annotations

import hashlib
import statistics
from collections import Counter, defaultdict

import torch

from conduit_dist.bench.token_baselines import FIELDS, Data


def _digests(mb: dict[str, torch.Tensor]) -> dict[int, list[bytes]]:
    """Each sequence's digest (its token fields' bytes, reward and group id) by group id."""
    cu = mb["cu_seqlens"].tolist()
    raw = {n: mb[n].contiguous().numpy().tobytes() for n, _ in FIELDS}
    width = {n: t.itemsize for n, t in FIELDS}
    reward = mb["reward"].contiguous().numpy().tobytes()
    out: dict[int, list[bytes]] = defaultdict(list)
    for i, g in enumerate(mb["group"].tolist()):
        h = hashlib.blake2b(digest_size=16)
        for n, _ in FIELDS:
            h.update(raw[n][cu[i] * width[n] : cu[i + 1] * width[n]])
        h.update(reward[4 * i : 4 * i + 4])
        h.update(int(g).to_bytes(8, "little", signed=True))
        out[g].append(h.digest())
    return out


def _group_digest(members: list[bytes]) -> bytes:
    return hashlib.blake2b(b"".join(sorted(members)), digest_size=16).digest()  # any order


def produced(d: Data) -> dict[int, bytes]:
    """What a producer put: group id -> digest of its members."""
    cu = torch.zeros(len(d.lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(d.lengths, 0)
    seqs = _digests({**d.fields, "reward": d.reward, "group": d.group, "cu_seqlens": cu})
    return {g: _group_digest(m) for g, m in seqs.items()}


def received(mbs: list[dict[str, torch.Tensor]], size: int) -> tuple[dict[int, bytes], bool, int]:
    """What a learner holds: group id -> digest, whether every group it holds came whole (all
    ``size`` members in one micro-batch and in no other), and its tokens."""
    where: Counter = Counter()
    groups: dict[int, bytes] = {}
    whole = True
    for mb in mbs:
        for g, members in _digests(mb).items():
            where[g] += 1
            whole &= len(members) == size
            groups[g] = _group_digest(members)
    whole &= all(c == 1 for c in where.values())
    return groups, whole, sum(int(mb["cu_seqlens"][-1]) for mb in mbs)


def judge(reports: list[dict], sides: tuple[str, ...]) -> dict[str, object]:
    """One sample's verdict from every rank's report: the producers' ``"put"`` maps
    (:func:`produced`), the learners' ``side -> received(...)`` and ``"micro"`` counts."""
    put: dict[int, bytes] = {}
    for r in reports:
        put |= r.get("put", {})
    out: dict[str, object] = {}
    for side in sides:
        got = [r[side] for r in reports if side in r]
        merged: dict[int, bytes] = {}
        for groups, _, _ in got:
            merged |= groups
        once = sum(len(g) for g, _, _ in got) == len(merged)  # no group on two learners
        out[f"{side}_digests"] = merged == put
        out[f"{side}_whole"] = once and all(w for _, w, _ in got) and merged.keys() == put.keys()
        tokens = [t for _, _, t in got]
        out[f"{side}_balance"] = max(tokens) / (sum(tokens) / len(tokens))
        out[f"{side}_micro"] = max(r["micro"][side] for r in reports if "micro" in r)
    out["tokens"] = sum(t for _, _, t in (r[sides[0]] for r in reports if sides[0] in r))
    return out


def summarise(verdicts: list[dict], sides: tuple[str, ...]) -> dict[str, object]:
    """The verdicts of every sample of a size together: checks all true, balance the median,
    micro-batches the most, tokens the mean."""
    out: dict[str, object] = {}
    for side in sides:
        out[f"{side}_digests"] = all(v[f"{side}_digests"] for v in verdicts)
        out[f"{side}_whole"] = all(v[f"{side}_whole"] for v in verdicts)
        out[f"{side}_balance"] = statistics.median(v[f"{side}_balance"] for v in verdicts)
        out[f"{side}_micro"] = max(v[f"{side}_micro"] for v in verdicts)
    out["tokens"] = statistics.mean(v["tokens"] for v in verdicts)
    return out
