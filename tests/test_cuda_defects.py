"""What a multi-GPU or NCCL job depends on, decided on CPU: every library thread sets its device,
one device per rank, the default group's NCCL timeout, a rank that never arrives at a plane's
group, the room shared memory needs, state dicts nobody changes, the gradients' collective, the
polled waits' latency and the heartbeats of mixed groups.

Each rule is a pure function (or a static property of the package) tested here; what needs a
process group runs on real gloo ranks (``dist_utils.run_ranks``).
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks

from conduit_dist.errors import ConfigError, RoundError
from conduit_dist.threads import bind_device, executor, start_thread

PACKAGE = Path(__file__).resolve().parents[1] / "conduit_dist"

# ------------------------------------------------------------------ 1. threads set their device

_THREAD_CALLS = {"Thread", "Timer", "ThreadPoolExecutor"}


def _thread_calls(path: Path) -> list[str]:
    """``file:line name`` of every ``Thread(``/``Timer(``/``ThreadPoolExecutor(`` call in a file
    (as ``threading.Thread(...)`` or a bare imported name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in _THREAD_CALLS:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_every_library_thread_is_started_by_the_helper_that_sets_its_device():
    helper = PACKAGE / "threads.py"
    raw = [c for p in sorted(PACKAGE.rglob("*.py")) if p != helper for c in _thread_calls(p)]
    assert raw == [], (
        "threads started outside conduit_dist/threads.py (use start_thread / executor, which "
        f"set the component's CUDA device first): {raw}"
    )
    assert _thread_calls(helper)  # the walk sees calls at all


def test_thread_helpers_run_named_threads_and_touch_no_cuda_on_cpu():
    seen = {}

    def work() -> None:
        seen["name"] = threading.current_thread().name

    for device in (None, torch.device("cpu")):
        t = start_thread(work, "conduit-test", device)
        t.join(10)
        assert not t.is_alive() and t.daemon and seen.pop("name") == "conduit-test"
        pool = executor("conduit-pool", device)
        try:
            name = pool.submit(lambda: threading.current_thread().name).result(10)
        finally:
            pool.shutdown()
        assert name.startswith("conduit-pool")
        bind_device(device)  # on this thread: nothing
    assert not torch.cuda.is_initialized()  # no CUDA call on a host device


def test_thread_helpers_refuse_an_unresolved_cuda_device_before_starting():
    before = threading.active_count()
    bare = torch.device("cuda")
    for call in (
        lambda: start_thread(lambda: None, "conduit-test", bare),
        lambda: executor("conduit-pool", bare),
        lambda: bind_device(bare),
    ):
        with pytest.raises(ConfigError, match=r"expected a resolved cuda:<index> or cpu, got cuda"):
            call()
    assert threading.active_count() == before


# ------------------------------------------------------------------ 2. one device per rank


def test_a_bare_cuda_without_local_rank_is_refused_in_a_job_of_several_ranks(monkeypatch):
    from conduit_dist.collectives.dist import device_ordinal

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(ConfigError) as exc:
        device_ordinal(None, 4, 8)  # every rank would take cuda:0
    msg = str(exc.value)
    assert msg.startswith("LOCAL_RANK: expected it set with WORLD_SIZE=8 and 4 visible CUDA"), msg
    assert "CUDA_VISIBLE_DEVICES='0,1,2,3'" in msg and "torchrun" in msg, msg
    assert "cuda:<index>" in msg, msg
    assert device_ordinal(None, 4, 1) == 0  # plain python: one rank
    assert device_ordinal(None, 4) == 0
    assert device_ordinal(None, 1, 8) == 0  # one visible device each (--gpus-per-task=1)
    assert device_ordinal(3, 4, 8) == 3  # torchrun
    with pytest.raises(ConfigError, match=r"LOCAL_RANK: expected 0 <= LOCAL_RANK < 4 .* got 4"):
        device_ordinal(4, 4, 8)


# ------------------------------------------------------------------ 3. the default group's timeout


def test_a_default_group_with_nccl_outlasts_the_planes_timeout_and_gloo_keeps_it():
    from datetime import timedelta

    from conduit_dist.collectives.dist import default_group_timeout, watchdog_timeout

    for s in (0.5, 120.0):
        t = timedelta(seconds=s)
        for backend in ("cpu:gloo,cuda:nccl", "nccl"):
            assert (
                default_group_timeout(backend, t)
                == watchdog_timeout(t)
                == 2 * t + timedelta(seconds=30)
            )
        for backend in ("gloo", "cpu:gloo,cuda:gloo", "cuda:gloo"):
            assert default_group_timeout(backend, t) == t


# ------------------------------------------------------------------ 4. a rank that never arrives

ARRIVAL_S = 3.0


def _never_arrives(rank: int, world: int):
    """Rank 1 never builds the plane: it waits until rank 0 has its error, then exits cleanly."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import conduit_dist as cd

    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["test/rank0-done"], timedelta(seconds=120))
        return None
    spec = cd.ExperienceSpec.from_batch({"x": torch.zeros(1, 3)})
    t0 = time.monotonic()
    try:
        cd.DataPlane(spec, 64, transport=cd.TransportConfig(timeout_s=ARRIVAL_S))
        out = "no error"
    except Exception as exc:
        phase, ranks = getattr(exc, "phase", None), list(getattr(exc, "ranks", ()))
        out = (type(exc).__name__, phase, ranks, str(exc), time.monotonic() - t0)
    store.set("test/rank0-done", "1")
    return out


def test_a_rank_that_never_builds_its_plane_fails_start_up_by_name_in_time():
    # the default group's timeout (what the group's rendezvous waited for) is much longer
    got = run_ranks(_never_arrives, 2, timeout_s=120, collective_timeout_s=40)[0]
    assert got != "no error"
    kind, phase, ranks, msg, waited = got
    assert kind == "PhaseError" and phase == "start-up: plane group", msg
    assert ranks == [1] and "ranks [1] never entered this phase" in msg, msg
    assert "failed on rank 0" in msg and f"timeout {ARRIVAL_S:g}s" in msg, msg
    assert ARRIVAL_S <= waited < ARRIVAL_S + 3.0, (waited, msg)


# ------------------------------------------------------------------ 5. room in /dev/shm


def test_shared_memory_is_admitted_on_what_every_rank_of_the_host_maps_at_start_up():
    from conduit_dist.collectives.model.calibration import PROBE_SIZES
    from conduit_dist.collectives.shm import header_bytes
    from conduit_dist.collectives.shm_open import MARGIN, room_for, startup_bytes

    largest = max(PROBE_SIZES)
    for world in (2, 4, 8):
        # two halves of the largest probe (world - 1 peers' bytes), and the generation before
        assert startup_bytes(world) > 2 * (header_bytes(world) + (world - 1) * largest)
    per_rank = startup_bytes(8)
    assert per_rank == 140 * 2**20 + 256  # 2 x (56 MiB + 14 MiB) and the headers
    gib = 1 << 30
    short = room_for(gib, 8, per_rank)  # 8 ranks' probes in a 1 GiB container: refused
    assert short == (
        "/dev/shm has 1024.0 MiB free, less than the 1184.0 MiB its 8 ranks need at start-up "
        "(8 x 140.0 MiB, calibration's largest probe in two generations of a rank's file, + "
        "64 MiB margin)"
    ), short
    assert room_for(8 * per_rank + MARGIN, 8, per_rank) == ""  # exactly enough
    assert room_for(8 * per_rank + MARGIN - 1, 8, per_rank) != ""
    assert room_for(gib, 2, startup_bytes(2)) == ""  # two ranks: 40 MiB + the margin


def _shm_room(rank: int, world: int, free: int, probe: int, wanted) -> dict[str, object]:
    """A plane's shared-memory decision where /dev/shm has ``free`` bytes and calibration's
    largest probe is ``probe`` bytes (neither is this machine's, so it decides alike anywhere)."""
    import logging

    from conduit_dist.collectives import shm_open
    from conduit_dist.collectives.exchange import Exchange
    from conduit_dist.collectives.model import calibration

    shm_open._free_bytes = lambda: free
    calibration.PROBE_SIZES = (1024, probe)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("conduit_dist").addHandler(handler)
    logging.getLogger("conduit_dist").setLevel(logging.INFO)
    try:
        ex = Exchange(10.0, shared_memory=wanted)
    except ConfigError as exc:
        return {"error": str(exc)}
    on = ex.shm is not None
    ex.close()
    return {"on": on, "said": said}


def test_auto_refuses_a_dev_shm_that_the_ranks_probes_would_overfill():
    mib = 1 << 20
    # 600 MiB free passed the old 512 MiB-per-rank check; 2 ranks each holding two halves of
    # a 256 MiB probe (and the generation before) need far more
    got = run_ranks(_shm_room, 2, 600 * mib, 256 * mib, "auto")
    assert not got[0]["on"] and not got[1]["on"], got
    assert any("/dev/shm has 600.0 MiB free, less than the" in m for m in got[0]["said"]), got
    roomy = run_ranks(_shm_room, 2, 600 * mib, 1024, "auto")
    assert roomy[0]["on"] and roomy[1]["on"], roomy
    required = run_ranks(_shm_room, 2, 600 * mib, 256 * mib, True)
    for r in required.values():
        assert r["error"].startswith("transport.shared_memory: /dev/shm has 600.0 MiB free, "), r
        assert "--shm-size" in r["error"] and "shared_memory=False" in r["error"], r


def _probe_growth(rank: int, world: int) -> tuple[int, int]:
    """The most a rank's files held at once while calibration ran over shared memory (the file
    it grew to and the one before it), and what :func:`startup_bytes` says."""
    from conduit_dist.collectives.exchange import Exchange
    from conduit_dist.collectives.model.calibration import calibrate
    from conduit_dist.collectives.shm import SharedMemory
    from conduit_dist.collectives.shm_open import startup_bytes
    from conduit_dist.collectives.topology import Topology

    grown: list[tuple[int, int]] = []
    grow = SharedMemory._grow

    def watched(self, need: int) -> None:
        old = self.cap
        grow(self, need)
        grown.append((old, self.cap))

    SharedMemory._grow = watched
    ex = Exchange(30.0, shared_memory=True)
    calibrate(ex, Topology.single_host(world), repeats=1)
    ex.close()
    return max(2 * (old + new) for old, new in grown), startup_bytes(world)


def test_start_up_need_is_what_calibration_grows_a_ranks_file_to():
    for held, need in run_ranks(_probe_growth, 2, timeout_s=180).values():
        assert held == need, (held, need)


# ------------------------------------------------------------------ 6. state dicts nobody changes


def _leaves(x, key: str = "") -> dict[str, object]:
    """A state dict's leaves by path (tensors as they are: not copied)."""
    if isinstance(x, dict):
        return {k: v for n, y in x.items() for k, v in _leaves(y, f"{key}/{n}").items()}
    if isinstance(x, list | tuple):
        return {k: v for n, y in enumerate(x) for k, v in _leaves(y, f"{key}/{n}").items()}
    return {key: x}


def _state_kept(rank: int, world: int, tiered: bool, disk_dir: str) -> list[str]:
    """Take a plane's state, then run rounds that overwrite every slot and every priority:
    the paths of the state's tensors that changed meanwhile."""
    import copy

    import conduit_dist as cd

    spec = cd.ExperienceSpec.from_batch({"id": torch.zeros(1, dtype=torch.int64)})
    storage = (
        cd.Tiers([("host", 8), ("disk", 24)], disk_dir=f"{disk_dir}/{rank}") if tiered else None
    )
    plane = cd.DataPlane(
        spec, 32, seed=1, schedule="sync", sampler=cd.Prioritized(0.6, 0.4, 0.0), storage=storage
    )

    def rounds(first: int, n: int) -> None:
        for it in range(first, first + n):
            ids = torch.arange(8) + 1000 * it + 100_000 * rank
            plane.put({"id": ids})
            batch = plane.fetch(8)
            plane.update_priorities(batch["_index"], torch.rand(8) + it)

    rounds(0, 6)  # the shard is full
    state = plane.state_dict()
    kept = copy.deepcopy(state)  # a clone taken at the same time
    rounds(6, 8)  # every slot is overwritten, every priority changes
    plane.close()
    got, want = _leaves(state), _leaves(kept)
    assert got.keys() == want.keys()
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    assert any(k.endswith("/data") for k in tensors), tensors  # the items are in it
    return [k for k in tensors if not torch.equal(got[k], want[k])]


def test_a_planes_state_dict_is_not_changed_by_later_rounds(tmp_path):
    for tiered in (False, True):
        for rank, changed in run_ranks(_state_kept, 2, tiered, str(tmp_path)).items():
            assert changed == [], (tiered, rank, changed)


# ------------------------------------------------------------------ 7. the gradients' collective


def test_auto_grad_sync_keeps_the_all_to_all_trick_for_gloo_and_all_reduces_on_nccl():
    from conduit_dist.collectives.dist import backend_for
    from conduit_dist.rl.grad_sync import SMALL_BUCKET_BYTES, bucket_collective

    mixed = "cpu:gloo,cuda:nccl"
    assert backend_for(mixed, cuda=True) == "nccl" and backend_for(mixed, cuda=False) == "gloo"
    assert backend_for("gloo", cuda=True) == backend_for("gloo", cuda=False) == "gloo"
    assert backend_for("cpu:gloo,cuda:gloo", cuda=True) == "gloo"
    small, large = 69_000, SMALL_BUCKET_BYTES + 1
    assert bucket_collective("auto", small, "gloo") == "all_to_all"  # the latency trick
    assert bucket_collective("auto", SMALL_BUCKET_BYTES, "gloo") == "all_to_all"
    assert bucket_collective("auto", large, "gloo") == "all_reduce"
    for n in (small, large):
        assert bucket_collective("auto", n, backend_for(mixed, cuda=True)) == "all_reduce"
        assert bucket_collective("allreduce", n, "gloo") == "all_reduce"
        assert bucket_collective("all_to_all", n, "nccl") == "all_to_all"  # asked for


def _grad_means(rank: int, world: int) -> dict[str, bool]:
    """Each mode and bucket size on a real gloo group averages to the mean of the ranks'."""
    import torch.distributed as dist

    from conduit_dist.rl.grad_sync import SMALL_BUCKET_BYTES, GradSync

    out = {}
    for mode in ("auto", "allreduce", "all_to_all"):
        sync = GradSync(dist.group.WORLD, mode)
        for n in (17_000, SMALL_BUCKET_BYTES // 4 + 1):  # float32: within and past the limit
            buf = torch.arange(n, dtype=torch.float32) + rank
            got = sync.reduce(buf).wait()
            want = torch.arange(n, dtype=torch.float32) + (world - 1) / 2
            out[f"{mode}/{n}"] = bool(torch.allclose(got, want))
    return out


def test_grad_sync_averages_every_bucket_on_gloo():
    for rank, got in run_ranks(_grad_means, 2).items():
        assert all(got.values()), (rank, got)


# ------------------------------------------------------------------ 8. polled waits' latency


class _Clock:
    """A clock that only moves when slept on or when the work is checked (``cost`` a check):
    a polled wait's schedule without any wall-clock time. The work completes at ``done_at``."""

    def __init__(self, done_at: float, cost: float = 1e-6) -> None:
        self.now, self.done_at, self.cost = 0.0, done_at, cost

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def done(self) -> bool:
        self.now += self.cost
        return self.now >= self.done_at


def test_a_polled_wait_sees_completion_within_a_tenth_of_the_time_waited(monkeypatch):
    from conduit_dist.collectives import heartbeats
    from conduit_dist.collectives.heartbeats import poll_pause, poll_until

    for waited in (0.0, 10e-6, 49e-6, 50e-6, 1.3e-3, 5e-3, 10e-3, 3.0):
        pause = poll_pause(waited)
        assert pause <= 0.1 * waited and pause <= 1e-3, (waited, pause)
    assert poll_pause(49e-6) == 0.0 and poll_pause(2e-3) == pytest.approx(2e-4)
    assert poll_pause(3.0) == 1e-3

    # poll_until itself, on that clock (a doubling 20 us .. 1 ms schedule saw 1.3 ms at 2.26)
    for done_at in (5e-6, 60e-6, 300e-6, 1.3e-3, 4e-3, 25e-3, 0.4):
        clock = _Clock(done_at)
        monkeypatch.setattr(heartbeats, "time", clock)
        assert poll_until(clock.done, 10.0)
        late = clock.now - done_at  # seen this long after it completed
        assert late <= min(0.1 * done_at, 1e-3) + 2 * clock.cost, (done_at, late)
    clock = _Clock(float("inf"))
    monkeypatch.setattr(heartbeats, "time", clock)
    assert not poll_until(clock.done, 0.5) and 0.5 <= clock.now <= 0.5 + 1e-3


# ------------------------------------------------------------------ 9. heartbeats of mixed groups


def test_host_waits_mark_lazily_on_a_mixed_group_and_nccl_waits_do_not():
    from conduit_dist.collectives.exchange import lazy_marks

    mixed = "cpu:gloo,cuda:nccl"
    assert lazy_marks(mixed, cuda=False)  # the meta/header exchange: gloo or shared memory
    assert not lazy_marks(mixed, cuda=True)  # NCCL: marked before it polls
    assert lazy_marks("gloo", cuda=False) and lazy_marks("gloo", cuda=True)
    assert lazy_marks("cpu:gloo,cuda:gloo", cuda=True)  # ranks sharing a GPU over gloo
    assert not lazy_marks("nccl", cuda=False)  # a group without gloo marks on arrival
    assert lazy_marks("", cuda=False)  # world size 1: nothing to mark


def _mixed_marks(rank: int, world: int) -> dict[int, list[int]]:
    """An exchange whose waits behave as on ``cpu:gloo,cuda:nccl`` (real gloo works; the
    ``cuda`` ones waited as NCCL's are, polled): the ranks without a mark for each round."""
    import torch.distributed as dist

    from conduit_dist.collectives.exchange import Exchange, lazy_marks

    ex = Exchange(10.0, name="mixed")
    ex._poll = True
    ex._lazy = {cuda: lazy_marks("cpu:gloo,cuda:nccl", cuda) for cuda in (False, True)}
    out = {}
    for r in range(1, 6):
        dist.barrier()  # the ranks start the round together: its host wait is quick
        ex.arrive(r)
        meta = ex.all_gather_start(torch.tensor([rank, r]), r).wait()
        assert meta[:, 1].tolist() == [r] * world
        if r == 5:  # a round with an NCCL-style wait: ordered on the device, checked later
            x = torch.ones(1)
            ex.run(lambda x=x: dist.all_reduce(x, group=ex.group, async_op=True), "x", r, True)
            out["kept"] = len(ex._device_works)
        dist.barrier()
        out[r] = list(ex.laggards(r))
    ex.arrive(6)  # the next round forgets the works that completed
    out["left"] = len(ex._device_works)
    ex.close()
    return out


def test_a_mixed_groups_quick_host_rounds_write_no_mark_and_a_rounds_nccl_work_is_kept():
    for rank, got in run_ranks(_mixed_marks, 2).items():
        # a host wait past the 50 ms grace (a loaded machine) may mark: most rounds do not
        assert any(got[r] == [0, 1] for r in range(1, 5)), (rank, got)
        # a round's NCCL work is not waited on the host (no poll, no mark): it is kept until a
        # later round sees it completed
        assert got["kept"] == 1 and got["left"] == 0, (rank, got)


class _Hung:
    """A collective's work that never completes (what a lost peer leaves an NCCL work as)."""

    def wait(self):  # NCCL: orders the current stream after it, returns at once
        return True

    def is_completed(self):
        return False


def test_a_rounds_nccl_work_still_running_after_the_timeout_fails_a_later_round_by_name():
    from conduit_dist.collectives.exchange import Exchange

    ex = Exchange(0.2)  # world size 1 (plain python): the bookkeeping alone
    ex._poll = True
    ex.run(lambda: _Hung(), "all_to_all(deliver)", 3, cuda=True)  # returns at once
    ex.arrive(4)  # not late yet
    time.sleep(0.3)
    late = r"round 3: all_to_all\(deliver\) has not completed on the device"
    with pytest.raises(RoundError, match=late):
        ex.arrive(5)
    ex.close()
