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
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks

from conduit_dist.errors import ConfigError
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
