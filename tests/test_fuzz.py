"""Property tests: a rejected ``put``, ``staged`` or ``update_priorities`` changes nothing.

Each example draws a few calls, invalid ones mixed with valid ones, against a plane whose rings
have wrapped. A call that raises must raise a documented error (``SpecError``/``ConfigError``, or
the producer's own exception out of a ``staged`` block) and leave every tier's bytes, the ring
counters, the staging buffers and the sampler's state exactly as before; an invalid call must
raise, a valid one must not. Every example ends with a round (on every rank, in step: the ranks
draw the same examples) whose batch and shard contents must be intact. World size 1 and 3; one
memory tier or host + disk ``cd.Tiers`` with background demotion; prioritized or uniform.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from dist_utils import run_ranks
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from plane_helpers import assert_intact, make_batch, spec

import conduit_dist as cd
from conduit_dist.errors import ConfigError, SpecError
from conduit_dist.sampling import RoutesFeedback

CAP = 12  # items per rank; a round adds a third of that, so the rings keep wrapping
DTYPE = {k: v.dtype for k, v in make_batch(torch.arange(1)).items()}
FIELDS = tuple(DTYPE)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
DTYPES += [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64]
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])
BAD_VERSIONS = st.integers(max_value=-1) | st.floats() | st.booleans() | st.text(max_size=2)
BAD_N = st.integers(max_value=0) | st.floats() | st.booleans() | st.none() | st.just(np.int64(2))
CONFIGS = [(tiered, sampler) for tiered in (False, True) for sampler in ("prioritized", "uniform")]


class Boom(Exception):
    """The producer's own failure inside a ``staged`` block."""


@dataclass
class Ctx:
    """The plane under test and what valid calls need: the latest fetched ``_index``."""

    plane: cd.DataPlane
    index: torch.Tensor
    next_id: int = 0

    def batch(self, n: int) -> dict[str, torch.Tensor]:
        """``n`` fresh items, ids unique over ranks (so any stored row can be checked)."""
        start = self.plane.rank * 10**7 + self.next_id
        self.next_id += n
        return make_batch(torch.arange(start, start + n))

    def room(self) -> int:
        """Items ``staged`` may still take before the next round (the global capacity)."""
        return CAP * self.plane.world - self.plane._p.stager.pending


@dataclass(frozen=True)
class Call:
    """One drawn call: ``run(ctx)`` makes it; a ``bad`` one must raise one of ``allowed``."""

    what: str
    run: Callable[[Ctx], object]
    bad: bool = True
    allowed: tuple[type[BaseException], ...] = (SpecError, ConfigError)

    def __repr__(self) -> str:
        return self.what


def flatten(x: object, key: str = "") -> dict[str, object]:
    """Nested dicts / lists of a ``state_dict`` as ``path -> leaf``, tensors copied."""
    if isinstance(x, Mapping):
        items = x.items()
    elif isinstance(x, list | tuple):
        items = enumerate(x)
    else:
        return {key: x.clone() if isinstance(x, torch.Tensor) else x}
    return {k: v for i, y in items for k, v in flatten(y, f"{key}/{i}").items()}


def snapshot(plane: cd.DataPlane) -> dict[str, object]:
    """Everything a call could change: tier bytes and ring counters (``shard.state_dict``),
    sizes and sampler state (priority leaves, queued updates), staging counts and bytes."""
    plane.shard.settle()  # the background demotion of the latest round is done
    stager = plane._p.stager
    bufs = [(b.count, b.data[: b.count], len(b.deferred)) for b in stager.buffers._bufs]
    counters = (stager.pending, stager.direct, stager.put_seq, stager.dropped, stager.versions.tag)
    return flatten(
        {
            "shard": plane.shard.state_dict(),
            "runner": plane._p.engine.state_dict(),
            "stager": (counters, stager.in_block, stager.buffers._cur, bufs),
            "plane": (plane.round, len(plane)),
        }
    )


def assert_same(before: dict[str, object], after: dict[str, object], what: str) -> None:
    """Every leaf of two snapshots is equal (tensors byte for byte)."""
    assert before.keys() == after.keys(), what
    for k, a in before.items():
        b = after[k]
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert same, f"{what}: {k} changed ({a!r} -> {b!r})"


def live_records(plane: cd.DataPlane) -> torch.Tensor:
    """The records of every item this rank's shard holds, over all its tiers."""
    sh = plane.shard
    if hasattr(sh, "rings"):
        return torch.cat([r.tier.data[(r.start + torch.arange(r.size)) % r.cap] for r in sh.rings])
    return sh.tier.data[: sh.size]


# ---------------------------------------------------------------- put


def _field_bads(name: str) -> st.SearchStrategy:
    """``(description, t -> replacement)`` making field ``name``'s tensor ``t`` invalid."""
    return st.sampled_from([
        *((f"as {d}", lambda t, d=d: t.to(d)) for d in DTYPES if d != DTYPE[name]),
        ("unsqueezed", lambda t: t.unsqueeze(-1)), ("scalar", lambda t: t[0]),
        ("narrowed", lambda t: t[..., :-1] if t.dim() > 1 else t[:, None].expand(-1, 2)),
        ("longer", lambda t: torch.cat([t, t[:1]])), ("shorter", lambda t: t[:-1]),
        ("as list", lambda t: t.tolist()), ("as numpy", lambda t: t.numpy()),
        ("as float", lambda t: 1.0), ("as None", lambda t: None),
        ("sparse", lambda t: t.to_sparse()), ("meta", lambda t: t.to("meta")),
    ])  # fmt: skip


BATCH_BADS = [
    ("empty", lambda b: {k: v[:0] for k, v in b.items()}),
    ("as items", lambda b: list(b.items())), ("as tuple", lambda b: tuple(b.values())),
    ("as None", lambda b: None), ("as tensor", lambda b: b["obs"]),
    *((f"extra {k!r}", lambda b, k=k: {**b, k: b["id"]}) for k in ("_version", "x", "", 0, None)),
    ("extra '_index', 7", lambda b: {**b, "_index": b["id"], 7: b["id"]}),  # mixed key types
]  # fmt: skip


@st.composite
def bad_batch(draw) -> tuple[str, Callable[[dict], object]]:
    """A description and a mutation that makes a valid batch invalid."""
    kind = draw(st.sampled_from(["field"] * 4 + ["missing", "nonfinite", "nonfinite", "batch"]))
    name = draw(st.sampled_from(FIELDS))
    if kind == "field":
        what, fix = draw(_field_bads(name))
        return f"{name} {what}", lambda b: {**b, name: fix(b[name])}
    if kind == "missing":
        return f"without {name}", lambda b: {k: v for k, v in b.items() if k != name}
    if kind == "batch":
        return draw(st.sampled_from(BATCH_BADS))
    name, value = draw(st.sampled_from(["obs", "reward"])), draw(NONFINITE)
    at = draw(st.integers(0, 10**6))  # a row and column, taken modulo the batch's

    def poison(b):
        t = b[name].clone()
        flat = t.view(t.shape[0], -1)
        flat[(at // 3) % flat.shape[0], at % flat.shape[1]] = value
        return {**b, name: t}

    return f"{value} in {name} at {at}", poison


@st.composite
def put_call(draw) -> Call:
    """A ``put``: valid (any size, donated or not, non-contiguous or not) or invalid."""
    n, donate = draw(st.integers(1, 2 * CAP)), draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:  # valid: the store takes it (dropping old staged items)
        version, strided = draw(st.none() | st.integers(0, 2**40)), draw(st.booleans())

        def put(ctx):
            b = ctx.batch(n)
            if strided:  # same values, non-contiguous rows
                b["frame"] = b["frame"].t().contiguous().t()
            ctx.plane.put(b, donate=donate, version=version)

        return Call(f"put({n}, donate={donate}, version={version})", put, bad=False)
    if draw(st.integers(0, 5)) == 0:
        version = draw(BAD_VERSIONS)
        return Call(f"put(version={version!r})", lambda c: c.plane.put(c.batch(n), version=version))
    what, mutate = draw(bad_batch())
    return Call(f"put({what}, n={n})", lambda c: c.plane.put(mutate(c.batch(n)), donate=donate))


# ---------------------------------------------------------------- staged

INSIDE = {  # plane calls refused inside a staged block
    "put": lambda c: c.plane.put(c.batch(2)),
    "flush": lambda c: c.plane.flush(),
    "fetch": lambda c: c.plane.fetch(2),
    "close": lambda c: c.plane.close(),
    "staged": lambda c: c.plane.staged(1).__enter__(),
    "update": lambda c: c.plane.update_priorities(c.index, torch.ones(c.index.shape[0])),
    "state_dict": lambda c: c.plane.state_dict(),
}


@st.composite
def staged_call(draw) -> Call:
    """A ``staged`` block: valid, a bad ``n`` or version, over the staging limit, a failing
    producer, NaN/inf written into the rows, or a plane call made inside the block."""
    kind = draw(st.sampled_from(["valid", "n", "version", "over", "raise", "nan", "inside"]))
    n, bad_n, version = draw(st.integers(1, CAP)), draw(BAD_N), draw(BAD_VERSIONS)
    upto, inner = draw(st.integers(0, 10**6)), draw(st.sampled_from(sorted(INSIDE)))
    name, value = draw(st.sampled_from(["obs", "reward"])), draw(NONFINITE)

    def block(ctx):
        k = {"n": bad_n, "over": ctx.room() + 1 + upto}.get(kind, min(n, ctx.room()))
        if kind in ("valid", "raise") and k < 1:  # no room left (a put filled staging)
            if kind == "raise":  # the producer fails before asking
                raise Boom("env crashed")
            return
        with ctx.plane.staged(k, version=version if kind == "version" else None) as rows:
            b, fields = ctx.batch(k), FIELDS[: upto % 6] if kind == "raise" else FIELDS
            for f in fields:
                rows[f].copy_(b[f])
            if kind == "raise":
                raise Boom("env crashed")
            if kind == "nan":
                rows[name][upto % k] = value
            if kind == "inside":
                INSIDE[inner](ctx)

    what = {"n": f"n={bad_n!r}", "version": f"version={version!r}", "over": f"over by {upto}"}
    what |= {"raise": "raising", "nan": f"{value} in {name}[{upto}]", "inside": f"{inner} inside"}
    return Call(
        f"staged({n}, {what.get(kind, 'valid')})", block, bad=kind != "valid",
        allowed=(Boom,) if kind == "raise" else (SpecError, ConfigError),
    )  # fmt: skip


# ---------------------------------------------------------------- update_priorities


def _at(t: torch.Tensor, at: int, value) -> torch.Tensor:
    """A copy of ``t`` with ``value`` at position ``at`` (modulo its length)."""
    t = t.clone()
    t[at % t.shape[0]] = value
    return t


UPDATE_BADS = {  # (index, priority, position, bad priority, bad address) -> invalid arguments
    "index int32": lambda i, p, *_: (i.int(), p), "index float": lambda i, p, *_: (i.double(), p),
    "index bool": lambda i, p, *_: (i.bool(), p), "index list": lambda i, p, *_: (i.tolist(), p),
    "priority int": lambda i, p, *_: (i, p.long()),
    "priority numpy": lambda i, p, *_: (i, p.numpy()),
    "2-D": lambda i, p, *_: (i[None], p[None]), "0-D": lambda i, p, *_: (i[0], p[0]),
    "shorter": lambda i, p, *_: (i, p[:-1]), "longer": lambda i, p, *_: (i, torch.cat([p, p[:1]])),
    "bad value": lambda i, p, at, v, _: (i, _at(p, at, v)),
    "no rank's": lambda i, p, at, _, r: (_at(i, at, r if r < 0 else r << 48), p),
}  # fmt: skip


@st.composite
def update_call(draw, routes: bool) -> Call:
    """An ``update_priorities`` of the latest fetched ``_index``: valid (finite priorities >= 0
    up to float64's largest, or addresses of items gone: dropped later) or invalid (on a uniform
    plane: any)."""
    values = draw(st.lists(st.floats(0, 1.7e308), min_size=1, max_size=4))
    wide = draw(st.sampled_from([torch.float64, torch.float32, torch.float16]))
    kind = draw(st.sampled_from(["valid", "valid", "gone", *UPDATE_BADS]))
    at, value = draw(st.integers(0, 10**6)), draw(NONFINITE | st.floats(-6e4, -1e-3))
    owner = draw(st.integers(3, 2**15 - 1) | st.integers(-(2**63), -1))  # ranks 3.. or < 0

    def update(ctx):
        index, k = ctx.index, ctx.index.shape[0]
        prio = torch.tensor([values[i % len(values)] for i in range(k)], dtype=torch.float64)
        prio = prio.to(wide).nan_to_num(posinf=1.0)  # narrower floats: in range
        if kind == "gone":  # generations far ahead of any written: dropped at the owner
            index = index + 10**6
        elif kind != "valid":
            index, prio = UPDATE_BADS[kind](index, prio, at, value, owner)
        ctx.plane.update_priorities(index, prio)

    bad = not routes or kind not in ("valid", "gone")
    return Call(f"update({kind}, {values}, {wide}, at={at}, {value}, {owner})", update, bad=bad)


# ---------------------------------------------------------------- the property


def make_plane(tiered: bool, sampler: str, disk_dir: str, **kw) -> cd.DataPlane:
    """A plane of ``CAP`` items per rank over one memory tier or host + disk tiers."""
    gbps = {"host": (10.0, 10.0), "disk": (1.0, 1.0)}  # declared: no calibration at start-up
    tiers = [("host", 4), ("disk", CAP - 4)]
    storage = cd.Tiers(tiers, disk_dir=disk_dir, gbps=gbps) if tiered else None
    if sampler == "prioritized":
        kw = {"sampler": cd.Prioritized(**kw), "placement": "local"}
    return cd.DataPlane(spec(), CAP, seed=5, storage=storage, schedule="sync", **kw)


def check_round(ctx: Ctx) -> None:
    """One round on every rank: intact batch and shard, finite masses; new valid addresses."""
    plane = ctx.plane
    plane.put(ctx.batch(CAP // 3))  # a third of the ring: the fetched items' updates apply
    b = plane.fetch(4)
    assert_intact(b)
    plane.shard.settle()
    assert_intact(plane._p.stager.spec.unpack(live_records(plane)))
    if isinstance(plane.sampler, RoutesFeedback):
        assert math.isfinite(plane.sampler.tree.total) and plane.sampler.tree.total > 0
        ctx.index = b["_index"]
        plane.update_priorities(ctx.index, torch.rand(4))


def wrapped(plane: cd.DataPlane) -> Ctx:
    """Fill ``plane`` past its capacity, over rounds on every rank, until every ring wrapped."""
    ctx = Ctx(plane, torch.zeros(4, dtype=torch.int64))
    plane.put(ctx.batch(2 * CAP))
    for _ in range(3):
        check_round(ctx)
    assert plane.shard.written > plane.shard.capacity
    return ctx


def fuzz(world: int, tiered: bool, sampler: str, disk_dir: str, examples: int) -> None:
    """Run the property on one plane (every rank draws the same examples, in step)."""
    plane = make_plane(tiered, sampler, disk_dir)
    ctx = wrapped(plane)
    routes = isinstance(plane.sampler, RoutesFeedback)
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if world == 1 else [])
    calls = st.lists(st.one_of(put_call(), staged_call(), update_call(routes)), max_size=6)

    @seed(CONFIGS.index((tiered, sampler)))  # the same examples on every rank, per config
    @settings(max_examples=examples, deadline=None, database=None, phases=phases,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(calls)
    def prop(calls: list[Call]) -> None:
        for call in calls:
            before = snapshot(plane)
            try:
                call.run(ctx)
            except Exception as exc:  # the type is part of the property
                assert call.bad, f"{call} was refused: {exc}"
                assert isinstance(exc, call.allowed), f"{call}: {type(exc).__name__}: {exc}"
                assert_same(before, snapshot(plane), repr(call))
            else:
                assert not call.bad, f"{call} was accepted"
        check_round(ctx)

    try:
        prop()
        assert not routes or plane.sampler.applied > 0  # valid updates reached their items
    finally:
        plane.close()


@pytest.mark.parametrize("tiered, sampler", CONFIGS)
def test_rejected_calls_change_nothing_world_1(tmp_path, tiered, sampler):
    cd.init_distributed()
    fuzz(1, tiered, sampler, str(tmp_path), examples=60)


def _ranks_fuzz(rank: int, world: int, examples: int) -> bool:
    with tempfile.TemporaryDirectory() as d:
        for tiered, sampler in CONFIGS:
            fuzz(world, tiered, sampler, d, examples)
    return True


def test_rejected_calls_change_nothing_world_3():
    assert run_ranks(_ranks_fuzz, 3, 30, timeout_s=240) == {0: True, 1: True, 2: True}


def test_cases_fuzzing_found(tmp_path):
    """Regressions, each failing before its fix: put raised TypeError on keys of mixed types,
    torch's RuntimeError on sparse or meta tensors, and accepted them donated in a non-float
    field (the next round then failed, and every later one); ``staged(True)`` staged an item;
    a priority above float32's range gave new items infinite masses (at world size 3 the round
    failed); at ``alpha=1`` finite masses whose sum overflows were accepted."""
    cd.init_distributed()
    plane = make_plane(True, "uniform", str(tmp_path))  # tiers: put stages, donated is deferred
    ctx = wrapped(plane)
    good = ctx.batch(3)
    for batch, match in [
        ({**good, "_version": good["id"], 7: good["id"]}, r"unexpected \['_version', 7\]"),
        ({**good, "id": good["id"].to_sparse()}, "'id': expected a dense tensor"),
        ({**good, "done": good["done"].to("meta")}, "'done': expected a dense tensor"),
    ]:
        before = snapshot(plane)
        with pytest.raises(SpecError, match=match):
            plane.put(batch, donate=True)
        assert_same(before, snapshot(plane), match)
    before = snapshot(plane)
    with pytest.raises(ConfigError, match="got True"), plane.staged(True) as rows:
        rows["id"].fill_(0)
    assert_same(before, snapshot(plane), "staged(True)")
    check_round(ctx)
    plane.close()
    plane = make_plane(False, "prioritized", str(tmp_path))
    ctx = wrapped(plane)
    plane.update_priorities(ctx.index, torch.full((4,), 1e300, dtype=torch.float64))
    check_round(ctx)  # applied: the largest priority is 1e300
    check_round(ctx)  # new items enter with it: their masses stay finite
    plane.close()
    plane = make_plane(False, "prioritized", str(tmp_path), alpha=1.0)
    ctx = wrapped(plane)
    before = snapshot(plane)
    with pytest.raises(ConfigError, match="must be finite over the store's 12 items"):
        plane.update_priorities(ctx.index, torch.full((4,), 1e308, dtype=torch.float64))
    assert_same(before, snapshot(plane), "overflowing masses")
    plane.close()
