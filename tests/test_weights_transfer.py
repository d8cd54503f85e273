"""Weights from several learners on 3 gloo ranks (learners 0 and 1, producer 2): each learner
sends its part, bucket by bucket, the producer loads only whole versions, and what every pull
loads is byte for byte exactly one published version, with buckets smaller than a tensor and
larger than the model, copied or loaded in place, while publishes race the rounds that send
the previous version."""

from __future__ import annotations

import hashlib

import pytest
import torch
from dist_utils import run_ranks
from test_tokens import G, group_batch, make_spec

import conduit_dist as cd
from conduit_dist.flow.weights import WeightsState

STEPS = 6


class Policy(torch.nn.Module):
    """Tensors of several sizes and dtypes (one straddles a part's edge)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(17, 9)
        self.b = torch.nn.Linear(9, 33, bias=False)
        self.register_buffer("h", torch.zeros(13, dtype=torch.bfloat16))
        self.register_buffer("n", torch.zeros((), dtype=torch.int64))


def set_version(policy: Policy, v: int) -> None:
    """Every learner's weights of version ``v`` (data parallel: the same on each)."""
    gen = torch.Generator().manual_seed(1000 + v)
    with torch.no_grad():
        for t in policy.state_dict().values():
            t.copy_(torch.randint(-999, 999, t.shape, generator=gen).to(t.dtype))


def state_digest(policy: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, t in policy.state_dict().items():
        h.update(k.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _race(rank: int, world: int, bucket_mb: float, in_place: bool, shm: bool) -> dict[str, object]:
    transport = cd.TransportConfig(timeout_s=30, weights_bucket_mb=bucket_mb, shared_memory=shm)
    tp = cd.TokenPlane(make_spec(), 64, 16_384, learner_ranks=[0, 1], producer_ranks=[2],
                       transport=transport)  # fmt: skip
    policy = Policy()
    out: dict[str, object] = {}
    if rank < 2:
        published = {}
        set_version(policy, 1)
        published[tp.publish_weights(policy)] = state_digest(policy)
        for _ in range(STEPS):
            tp.fetch_start(2, 400, next_version=False)  # sends the version published so far
            v = tp.version + 1
            set_version(policy, v)  # the module changes while that round runs ...
            published[tp.publish_weights(policy)] = state_digest(policy)  # ... a new version
            tp.fetch(2, 400)
        out = {"published": published, "last": tp.weights.last}
    else:
        loads, gid = [], 0
        while True:
            tp.put(*group_batch([gid, gid + 1]))
            gid += 2
            if not tp.flush():
                break
            v = tp.pull_weights(policy, in_place=in_place)
            loads.append((v, state_digest(policy)))
        out = {"loads": loads, "last": tp.weights.last}
    tp.close()
    out["last"] = vars(out["last"])
    return out


@pytest.mark.parametrize(
    ("bucket_mb", "in_place", "shm"),
    [(8 / (1 << 20), False, False), (4.0, True, False), (4.0, False, True), (4.0, True, True)],
)
def test_every_pull_loads_exactly_one_published_version_never_a_torn_one(bucket_mb, in_place, shm):
    res = run_ranks(_race, 3, bucket_mb, in_place, shm, timeout_s=150)
    published = res[0]["published"]
    assert published == res[1]["published"] and len(published) == STEPS + 1
    assert len(set(published.values())) == STEPS + 1  # each version's weights differ
    loads = [(v, d) for v, d in res[2]["loads"] if v > 0]
    assert len({v for v, _ in loads}) >= STEPS - 1, res[2]["loads"]  # versions arrived
    for v, d in loads:
        assert published[v] == d, v  # exactly the version it says, byte for byte
    model = sum(t.numel() * t.element_size() for t in Policy().state_dict().values())
    last = {r: res[r]["last"] for r in res}
    assert last[0]["owners"] == [0, 1] or last[0]["owners"] == (0, 1)
    schedule = "shm" if shm else "p2p"
    for r in (0, 1):  # each learner sent (or packed into its file) a part, about half
        assert last[r]["schedule"] == schedule and last[r]["received"] == 0
        assert 0.3 * model < last[r]["sent"] < 0.7 * model + 1024
    assert last[2]["sent"] == 0 and last[2]["received"] == last[0]["sent"] + last[1]["sent"]
    if bucket_mb < 1:  # 8-byte buckets: many per tensor
        assert last[2]["buckets"] > 2 * len(Policy().state_dict())
    else:  # one per learner's part (sent, or copied out of its file)
        assert last[2]["buckets"] == 2


def _send_now(rank: int, world: int, shm: bool) -> dict[str, object]:
    """Learners publish with ``send_now``: the round in the call packs each 64-byte bucket just
    before sending it (shared memory: packed into the learner's file first); the producer
    flushes (that round) and pulls."""
    transport = cd.TransportConfig(
        timeout_s=30, weights_bucket_mb=64 / (1 << 20), shared_memory=shm
    )
    tp = cd.TokenPlane(make_spec(), 64, 16_384, learner_ranks=[0, 1], producer_ranks=[2],
                       transport=transport)  # fmt: skip
    policy = Policy()
    if rank < 2:
        published = {}
        for v in range(1, STEPS + 1):
            set_version(policy, v)
            published[tp.publish_weights(policy, send_now=True)] = state_digest(policy)
            set_version(policy, 0)  # the module changes once the call returns
        tp.close()
        return {"published": published, "whole": tp.weights.whole()[0]}
    loads = []
    while tp.flush():
        loads.append((tp.pull_weights(policy), state_digest(policy)))
    tp.close()
    return {"loads": loads}


@pytest.mark.parametrize("shm", [False, True])
def test_send_now_packs_in_the_round_and_the_producer_loads_every_version_exactly(shm):
    res = run_ranks(_send_now, 3, shm, timeout_s=120)
    published = res[0]["published"]
    assert published == res[1]["published"] and sorted(published) == list(range(1, STEPS + 1))
    assert res[2]["loads"][:STEPS] == [(v, published[v]) for v in range(1, STEPS + 1)]
    assert res[0]["whole"] == 0  # a learner holds its part only (no ingress)


def _mismatch(rank: int, world: int) -> dict[str, object]:
    tp = cd.TokenPlane(make_spec(), 64, 16_384, learner_ranks=[0, 1], producer_ranks=[2])
    policy = Policy()
    if rank < 2:
        tp.publish_weights(policy)
        if rank == 1:
            tp.publish_weights(policy)  # one version more than learner 0
        try:
            tp.fetch(2, 400)
        except cd.ConfigError as exc:
            return {"error": str(exc)}
        return {}
    tp.put(*group_batch([0, 1]))
    try:
        tp.flush()
    except cd.ConfigError as exc:
        return {"error": str(exc)}
    return {}


def test_learners_publishing_different_versions_is_refused_on_every_rank():
    res = run_ranks(_mismatch, 3, allow_failure=True)
    for r in res.values():
        err = r["error"] if isinstance(r, dict) else r[1]
        assert "the learners' published weights differ" in err, err
        assert "expected the same on every learner" in err


def _rows(rank: int, world: int) -> dict[str, object]:
    """A DataPlane with learners 0 and 1 and actor 2: learner 1 skips a publish once (it falls
    behind the first learner), and the actor loads every version the first learner sent."""
    spec = cd.ExperienceSpec({"x": ((2,), torch.float32)})
    transport = cd.TransportConfig(timeout_s=30, weights_bucket_mb=256 / (1 << 20))
    plane = cd.DataPlane(spec, 64, learner_ranks=[0, 1], transport=transport)
    policy = Policy()
    out: dict[str, object] = {"published": {}, "loads": [], "owners": []}
    for v in range(1, 5):
        plane.put({"x": torch.zeros(2, 2)})
        if rank < 2:
            if not (rank == 1 and v == 3):  # learner 1 skips version 3 once
                set_version(policy, v)
                out["published"][plane.publish_weights(policy)] = state_digest(policy)
            plane.fetch(2)
        else:
            plane.flush()
            out["loads"].append((plane.pull_weights(policy), state_digest(policy)))
        out["owners"].append(list(plane._p.weights.last.owners))
    plane.close()
    return out


def test_data_plane_learners_at_the_first_learners_version_share_the_sending():
    res = run_ranks(_rows, 3, timeout_s=120)
    first = res[0]["published"]
    loads = [(v, d) for v, d in res[2]["loads"] if v]
    assert loads and all(first[v] == d for v, d in loads)  # the first learner's versions
    owners = res[2]["owners"]
    assert [0, 1] in owners and [0] in owners  # both sent, and learner 0 alone while 1 lagged


def _serving(rank: int, world: int, run_dir: str, shm: bool) -> dict[int, object]:
    """Every rank opens an ingress: learners serve whole versions, so each receives the other
    learner's part (a rank both sending and receiving in one transfer)."""
    transport = cd.TransportConfig(timeout_s=30, shared_memory=shm)
    tp = cd.TokenPlane(make_spec(), 64, 16_384, learner_ranks=[0, 1], producer_ranks=[2],
                       transport=transport)  # fmt: skip
    tp.open_ingress(run_dir)
    policy, out = Policy(), {}
    for v in range(1, 4):
        if rank < 2:
            set_version(policy, v)
            tp.publish_weights(policy)
            tp.fetch(2, 400)
            version, buf = tp.weights.whole()
            ref = WeightsState()
            ref.publish(policy)
            out[v] = (version, buf is not None and torch.equal(buf[: ref.buf.numel()], ref.buf))
        else:
            tp.put(*group_batch([2 * v, 2 * v + 1]))
            tp.flush()
    out["schedule"] = tp.weights.last.schedule
    tp.close()
    return out


@pytest.mark.parametrize("shm", [False, True])
def test_learners_serving_an_ingress_hold_every_version_whole(tmp_path, shm):
    res = run_ranks(_serving, 3, str(tmp_path), shm, timeout_s=120)
    for r in (0, 1):
        assert res[r]["schedule"] == ("shm" if shm else "p2p")
        assert [res[r][v] for v in (1, 2, 3)] == [(1, True), (2, True), (3, True)]


assert G >= 2  # each put above is two whole groups


def set_sharded(policy: torch.nn.Module, v: int) -> None:
    """``set_version`` on a sharded module: each rank writes its rows (``torch.chunk``'s split,
    FSDP2's) of the same full tensors."""
    gen = torch.Generator().manual_seed(1000 + v)
    with torch.no_grad():
        for t in policy.state_dict().values():
            full = torch.randint(-999, 999, t.shape, generator=gen).to(t.dtype)
            if hasattr(t, "to_local"):
                mesh = t.device_mesh
                full = torch.chunk(full, mesh.size(), dim=0)[mesh.get_coordinate()[0]]
                t = t.to_local()
            t.copy_(full)


def _fsdp(rank: int, world: int, shm: bool, plane: str, run_dir: str | None) -> dict[str, object]:
    """Learners 0 and 1 hold an FSDP2 ``fully_shard`` policy (Shard(0) DTensors, plain
    buffers); producer 2 an unsharded one. Each learner sends only what it holds. With
    ``run_dir``, learners serve an ingress (each also receives the other's shards) and then
    pull the whole version into a second sharded module (each copies its rows)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh("cpu", [0, 1])  # every rank builds it (a collective); 2 holds no shard
    transport = cd.TransportConfig(timeout_s=30, weights_bucket_mb=64 / (1 << 20),
                                   shared_memory=shm)  # fmt: skip
    if plane == "tokens":
        tp = cd.TokenPlane(make_spec(), 64, 16_384, learner_ranks=[0, 1], producer_ranks=[2],
                           transport=transport)  # fmt: skip
        if run_dir is not None:
            tp.open_ingress(run_dir)
    else:
        spec = cd.ExperienceSpec({"x": ((2,), torch.float32)})
        tp = cd.DataPlane(spec, 64, learner_ranks=[0, 1], transport=transport)
    policy = Policy()
    out: dict[str, object] = {"loads": []}
    if rank < 2:
        fully_shard(policy, mesh=mesh)
    for v in range(1, 4):
        if plane != "tokens":
            tp.put({"x": torch.zeros(2, 2)})
        if rank < 2:
            set_sharded(policy, v)
            tp.publish_weights(policy)
            if plane == "tokens":
                tp.fetch(2, 400)
            else:
                tp.fetch(2)
        else:
            if plane == "tokens":
                tp.put(*group_batch([2 * v, 2 * v + 1]))
            tp.flush()
            out["loads"].append((tp.pull_weights(policy), state_digest(policy)))
        weights = tp.weights if plane == "tokens" else tp._p.weights
        out["last"] = dict(vars(weights.last))
    if run_dir is not None and rank < 2:  # the whole version, copied into a sharded module
        other = Policy()
        fully_shard(other, mesh=mesh)
        out["pulled"] = tp.pull_weights(other)
        set_sharded(policy, out["pulled"])
        out["rows_equal"] = all(
            torch.equal(a.to_local(), b.to_local()) if hasattr(a, "to_local") else torch.equal(a, b)
            for a, b in zip(other.state_dict().values(), policy.state_dict().values())
        )
        try:
            tp.pull_weights(other, in_place=True)
        except cd.SpecError as exc:
            out["in_place"] = str(exc)
    tp.close()
    return out


@pytest.mark.parametrize(
    ("shm", "plane", "serve"),
    [
        (False, "tokens", False),
        (True, "tokens", True),
        (False, "tokens", True),
        (False, "rows", False),
    ],
)
def test_a_sharded_fsdp2_model_is_sent_shard_by_shard_and_loads_whole(tmp_path, shm, plane, serve):
    res = run_ranks(_fsdp, 3, shm, plane, str(tmp_path) if serve else None, timeout_s=120)
    ref = Policy()
    expected = []
    for v in range(1, 4):
        set_version(ref, v)
        expected.append((v, state_digest(ref)))
    loads = res[2]["loads"]
    if plane != "tokens":  # a DataPlane round sends what was published before it started
        assert loads[0][0] == 0
        loads = loads[1:]
        expected = expected[: len(loads)]
    assert loads == expected  # the whole model, byte for byte, every version
    params = sum(p.numel() * p.element_size() for p in ref.parameters())
    sent = {r: res[r]["last"]["sent"] / (2 if serve and not shm else 1) for r in (0, 1)}
    for r in (0, 1):  # each learner sent what it holds: its rows, about half the parameters
        last = res[r]["last"]
        assert list(last["owners"]) == [0, 1]
        assert 0.3 * params < sent[r] < 0.7 * params + 1024, (r, last, params)
        if serve:  # it also received the other's shards, and loads its rows of the whole
            assert last["received"] == sent[1 - r]
            assert res[r]["pulled"] == 3 and res[r]["rows_equal"]
            assert "pull(in_place=True) into a sharded module" in res[r]["in_place"]
        else:
            assert last["received"] == 0
    assert res[2]["last"]["received"] == sent[0] + sent[1]


def _fsdp_refused(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Linear(6, 4)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(1)]))
    try:
        WeightsState().publish(model)
    except cd.SpecError as exc:
        return str(exc)
    return "published"


def test_a_state_sharded_other_than_by_rows_is_refused_naming_the_tensor():
    res = run_ranks(_fsdp_refused, 2)
    for msg in res.values():
        assert "'weight' is a DTensor placed as (Shard(dim=1),)" in msg, msg
        assert "expected Shard(0)" in msg


def _in_files(rank: int, world: int) -> dict[str, object]:
    """Shared memory: the producer loads version 1 in place (views of the learners' files),
    then stops pulling while the learners publish 6 more; its module must still hold version 1
    byte for byte (no file it views is packed again). Then it pulls the newest."""
    transport = cd.TransportConfig(timeout_s=30, shared_memory=True)
    tp = cd.TokenPlane(make_spec(), 64, 16_384, learner_ranks=[0, 1], producer_ranks=[2],
                       transport=transport)  # fmt: skip
    policy = Policy()
    out: dict[str, object] = {}
    for v in range(1, 8):
        if rank < 2:
            set_version(policy, v)
            tp.publish_weights(policy)
            tp.fetch(2, 400)
        else:
            tp.put(*group_batch([2 * v, 2 * v + 1]))
            tp.flush()
            if v == 1:
                out["pulled"] = tp.pull_weights(policy, in_place=True)
                spans = []  # the learners' weights files mapped here (/proc/self/maps)
                with open("/proc/self/maps") as maps:
                    for line in maps:
                        if "-w0-" in line or "-w1-" in line:
                            a, b = (int(x, 16) for x in line.split()[0].split("-"))
                            spans.append((a, b))
                inside = [
                    any(a <= t.data_ptr() < b for a, b in spans)
                    for t in policy.state_dict().values()
                ]
                out["views_files"] = sum(inside) >= len(inside) - 1  # a straddler is copied
                out["held"] = tp.weights.held()
                scratch = Policy()  # a module loaded in place writes to its own pages only
                tp.pull_weights(scratch, in_place=True)
                with torch.no_grad():
                    for t in scratch.state_dict().values():
                        t.zero_()
                check = Policy()
                tp.pull_weights(check)  # copied out of the learners' files: still version 1
                out["files_intact"] = state_digest(check)
                del scratch  # (while it lives, version 1 counts as viewed)
    if rank == 2:
        out["kept"] = state_digest(policy)
        out["newest"] = tp.pull_weights(policy, in_place=True)
        out["after"] = state_digest(policy)
        out["last"] = dict(vars(tp.weights.last))
        tp.pull_weights(policy)  # a copy over views of files: tensors of its own instead
        out["held_after_copy"] = tp.weights.held()
        out["after_copy"] = state_digest(policy)
    else:
        out["slots"] = len(tp.weights.files._mine)
    tp.close()
    return out


def test_producers_read_learners_files_in_place_and_no_file_they_view_is_packed_again():
    res = run_ranks(_in_files, 3, timeout_s=120)
    ref = Policy()
    set_version(ref, 1)
    first = state_digest(ref)
    set_version(ref, 7)
    newest = state_digest(ref)
    p = res[2]
    assert p["pulled"] == 1 and p["views_files"] and p["held"] == (1, 0, 1, 1)
    assert p["files_intact"] == first
    assert p["kept"] == first  # 6 versions later, the views still hold version 1
    assert p["newest"] == 7 and p["after"] == newest
    assert p["last"]["schedule"] == "shm" and p["last"]["buckets"] == 2
    assert p["last"]["received"] > 0 and p["last"]["sent"] == 0
    assert p["held_after_copy"] == (7, 0, 0, 0) and p["after_copy"] == newest
    for r in (0, 1):  # version 1's file stayed held, the others were packed again
        assert 3 <= res[r]["slots"] <= 4, res[r]


def _fsdp_lag(rank: int, world: int) -> str:
    """A DataPlane whose learners hold a sharded policy; learner 1 skips a publish."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh("cpu", [0, 1])
    spec = cd.ExperienceSpec({"x": ((2,), torch.float32)})
    plane = cd.DataPlane(spec, 64, learner_ranks=[0, 1],
                         transport=cd.TransportConfig(timeout_s=20))  # fmt: skip
    policy = Policy()
    if rank < 2:
        fully_shard(policy, mesh=mesh)
    try:
        for v in range(1, 4):
            plane.put({"x": torch.zeros(2, 2)})
            if rank < 2:
                if not (rank == 1 and v == 2):
                    set_sharded(policy, v)
                    plane.publish_weights(policy)
                plane.fetch(2)
            else:
                plane.flush()
    except (cd.SpecError, cd.RoundError) as exc:
        return str(exc)
    finally:
        plane.close()
    return "no error"


def test_a_data_plane_learner_out_of_step_with_a_sharded_state_is_refused_on_every_rank():
    res = run_ranks(_fsdp_lag, 3, timeout_s=120)
    for r, msg in res.items():
        assert "learner ranks [1] published another version than learner 0" in msg, (r, msg)
