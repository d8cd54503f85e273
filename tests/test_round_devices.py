"""Where a plane's tiers, rows and collectives go (``rounds.devices.plan_devices``), and how rows
land on the learner's device: rows stay where they are stored, whatever the sampler (composed on
the GPU from host metadata, ``sampling/device_rows.py``), bulk rows go by NCCL, metadata stays on
the host, and only a plane told to keep its first tier in host memory lands rows with one pinned
copy (``rounds.delivery.Landing``).

These are decisions; no GPU is needed to check them (``torch.device("cuda", 0)`` is a plain
value). The device path's logic runs on the CPU in ``tests/test_device_rows.py``; the copies
themselves in ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import ROOT
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import conduit_dist as cd
from conduit_dist.records.buffers import OutputPool
from conduit_dist.rounds.delivery import Landing
from conduit_dist.rounds.devices import plan_devices
from conduit_dist.rounds.wire import _RecvPool
from conduit_dist.train import setup
from conduit_dist.train.config import register, validate

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)

SAMPLERS = {
    "uniform": lambda: cd.Uniform(),
    "stratified": lambda: cd.Stratified(),
    "queue": lambda: cd.Fifo(),
    "lifo": lambda: cd.Lifo(),
    "without_replacement": lambda: cd.WithoutReplacement(),
    "prioritized": lambda: cd.Prioritized(),
    "n_step": lambda: cd.Prioritized(sequence=cd.Windows(n_step=3, stream="env")),
    "slices": lambda: cd.Prioritized(sequence=cd.Windows(length=4, stream="env")),
}


def _plan(sampler="prioritized", **kw):
    args = dict(device=GPU, world=2, sampler=SAMPLERS[sampler](), keeps_local=True)
    return plan_devices(**{**args, **kw, "rehearse": False})


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_every_sampler_composes_its_rows_where_the_gpu_storage_is(kind):
    """Prioritized trees, windows and n-step values are host metadata: no sampler pulls a GPU
    plane's rows to the host any more."""
    for keeps_local in (True, False):
        for world in (1, 2, 8):
            plan = _plan(kind, keeps_local=keeps_local, world=world)
            assert plan.rows == GPU and plan.tier == GPU and plan.compose == "torch"
            assert plan.candidates is False  # the headers are host memory: no rows in them
            assert plan.bulk == ("none" if world == 1 else "nccl")
            assert plan.nccl is (world > 1) and plan.round_thread is (world > 1)
            want = "local" if world == 1 else ("fused" if keeps_local else "general")
            assert plan.schedule == want


def test_cpu_planes_keep_the_native_host_path_and_their_schedules():
    for kind in SAMPLERS:
        plan = _plan(kind, device=CPU)
        assert plan.rows == CPU and plan.compose == "native" and not plan.nccl
        assert plan.bulk == "host" and not plan.round_thread
        assert plan.candidates is (
            kind not in ("stratified", "queue", "lifo", "without_replacement")
        )
    assert _plan(device=CPU, world=1).schedule == "local"
    assert _plan(device=CPU, keeps_local=False).schedule == "general"
    # the rehearsal runs the device path on host tensors: no candidates, torch composition
    rehearsed = plan_devices(
        device=CPU, world=2, sampler=cd.Prioritized(), keeps_local=True, rehearse=True
    )
    assert rehearsed.compose == "torch" and not rehearsed.candidates and rehearsed.bulk == "host"


def test_host_first_tier_lands_rows_with_one_copy_and_builds_no_nccl_communicator():
    for first in (CPU, torch.device("cuda", 1)):
        plan = _plan(first_tier=first)
        assert plan.rows == CPU and plan.compose == "native" and plan.bulk == "host"
        assert not plan.nccl and not plan.cuda_group  # no CUDA tensor passes the group
        assert str(first) in plan.why
    # a device first tier on the plane's GPU is the default's choice
    assert _plan(first_tier=GPU).rows == GPU


def test_payloads_are_all_reduced_on_the_device_and_need_the_group():
    gpu = _plan(reduce_numel=100, first_tier=CPU)  # host rows, a GPU payload
    assert gpu.payload == "allreduce" and gpu.nccl and gpu.cuda_group and gpu.bulk == "host"
    assert _plan(reduce_numel=100, device=CPU).payload == "header"
    assert _plan(reduce_numel=100, world=1).payload == "none"
    # ranks sharing one GPU: CUDA tensors over gloo, no NCCL communicator
    shared = _plan(cuda_backend="gloo")
    assert shared.bulk == "gloo" and not shared.nccl and shared.cuda_group


def _cfg(*overrides: str):
    register()  # the structured schema Hydra composes first (train.py registers it too)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose("config", overrides=["logger=none", *overrides])
    cfg = OmegaConf.to_object(dcfg)
    validate(cfg)
    return cfg


def test_the_default_experiment_on_cuda_keeps_its_first_tier_where_rows_are_composed():
    """``train.py device=cuda`` (prioritized 3-step windows, colocated, local placement): the
    one tier on the learner's GPU, rows composed there, bulk rows on NCCL, the gradients
    all-reduced in the round on the same communicator (the job's only NCCL one)."""
    cfg = _cfg("device=cuda")
    for world in (2, 4):
        plan = setup.device_plan(cfg, world)
        assert plan.tier == GPU and plan.rows == GPU and plan.compose == "torch"
        assert plan.bulk == "nccl" and plan.nccl and plan.round_thread
        assert plan.schedule == "fused" and plan.payload == "allreduce"
        assert setup.grad_sync(cfg, list(range(world)), GPU) == "round"
    one = setup.device_plan(cfg, 1)
    assert one.rows == GPU and one.schedule == "local" and not one.nccl
    # the same job on the CPU: the native host path, gradients in the header exchange
    cpu = setup.device_plan(_cfg(), 2)
    assert cpu.rows == CPU and cpu.compose == "native" and cpu.payload == "header"
    # told to keep the store on the host: rows composed there, landed, no NCCL for rows
    host = setup.device_plan(_cfg("device=cuda", "plane.tiers=[[host,50000]]"), 2)
    assert host.rows == CPU and host.bulk == "host" and host.payload == "allreduce"
    # disaggregated DQN (round_robin): general rounds, DDP all-reduce on the GPU
    dis = _cfg("device=cuda", "mode=disaggregated", "learner_ranks=[0,1]")
    plan = setup.device_plan(dis, 3)
    assert plan.schedule == "general" and plan.bulk == "nccl" and plan.payload == "none"
    assert setup.grad_sync(dis, [0, 1], GPU) == "allreduce"
    ppo = setup.device_plan(_cfg("device=cuda", "experiment=cartpole_ppo"), 2)
    assert ppo.rows == GPU and ppo.bulk == "nccl" and ppo.schedule == "fused"


def test_landing_on_the_same_device_is_the_rows_themselves():
    land = Landing(16, CPU, CPU, lambda r: {"x": r})
    assert not land.moves and land.rows is land.outputs
    rows = land.rows.acquire(5)
    assert land.land(rows) is rows
    assert land.land(land.rows.acquire(0)).shape == (0, 16)


def test_landing_only_from_the_host_to_a_gpu():
    with pytest.raises(ValueError, match="land on a GPU from the host only"):
        Landing(16, GPU, CPU, lambda r: {"x": r})


def test_a_pooled_host_buffer_waits_for_the_copy_that_read_it():
    """The pinned pool hands a buffer to the host again only after the event of the device
    copy that last read it (an object with ``query`` stands for the CUDA event here: it passes
    at its third query)."""
    pool = OutputPool(16, CPU, lambda r: {"x": r})
    first = pool.acquire(4)
    queried = []

    class Event:
        def query(self):
            queried.append(True)
            return len(queried) >= 3  # the copy has not run yet: the pool polls until it has

    pool.read_by(first, Event())
    del first
    again = pool.acquire(4)
    assert len(queried) == 3
    del again
    pool.acquire(4)
    assert len(queried) == 3  # once: the event is cleared after the wait


def test_a_started_round_runs_both_halves_on_the_side_stream(monkeypatch):
    """``fetch_start``'s half of a round (donated puts packed, the local ingest into a device
    tier, the header launch) is enqueued on the round's side stream, after the ticket's event,
    like its finish: on the consumer's stream the finish's gathers and its end event would not
    be ordered after those copies. Fake stream and events stand for CUDA's here."""

    from conduit_dist.rounds.tickets import RoundStats, RoundTicket
    from conduit_dist.sched.scheduler import Scheduler

    seen = []

    class Stream:
        current = False

        def wait_event(self, event):
            seen.append(("wait", event))

        def record_event(self):
            return "done"

    side = Stream()

    class Context:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            self.stream.current = True

        def __exit__(self, *exc):
            self.stream.current = False

    class Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    class Engine:
        def start(self, ticket, weights):
            seen.append(("start", side.current))

            def finish():
                seen.append(("finish", side.current))
                return torch.empty(0, 8, dtype=torch.uint8), RoundStats()

            finish.poll = lambda: None  # RoundEngine.start's finish: notes the flight in flight
            return finish

    monkeypatch.setattr(torch.cuda, "stream", Context)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    sched = Scheduler("sync", Engine(), None, CPU, timeout_s=1.0)
    sched._stream = side  # what a CUDA plane's scheduler holds
    ticket = RoundTicket(0, 4, None, 0, None, ready="ready")
    sched.start(ticket, "prefetch", 0)
    assert seen == [("wait", "ready"), ("start", True)]
    sched.pending.future.result()
    assert seen[2:] == [("wait", "ready"), ("finish", True)]


def test_a_held_batch_is_never_handed_out_again_whatever_held_it_when_its_views_were_built():
    """The pool's idle count must not absorb a tensor held on the buffer when its field views
    are first built (the caller's own batch, or a slice an exchange's thread still holds): a
    buffer would then look free while a caller still reads it, and a later round overwrite it."""
    spec = cd.ExperienceSpec.from_batch(
        {"a": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.int64)}
    )
    pool = OutputPool(spec.record_bytes, CPU, spec.unpack)
    buf = pool.acquire(8)
    straggler = buf[:4]  # e.g. the exchange's output slice, not released yet
    fields = pool.unpack(buf)
    del straggler, buf
    kept = fields["b"]  # the caller keeps one field of its batch
    del fields
    again = pool.acquire(8)
    assert again.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
    del kept, again
    reused = pool.acquire(8)  # once nobody holds it, the buffer is reused
    assert reused.untyped_storage().data_ptr() == pool._pool[0].buf.untyped_storage().data_ptr()


def test_a_receive_buffer_is_reused_once_dropped_and_never_while_held():
    """The header exchange's receive pool: its numpy view is taken before the idle count (so a
    dropped buffer is reused), and a held slice keeps its buffer out of the next round."""
    pool = _RecvPool(8, CPU)
    buf, _ = pool.acquire(10)
    ptr = buf.untyped_storage().data_ptr()
    held = buf[:3]  # a batch delivered as the received rows themselves
    del buf
    other, _ = pool.acquire(10)
    assert other.untyped_storage().data_ptr() != ptr
    del held, other
    again, view = pool.acquire(10)
    assert again.untyped_storage().data_ptr() == ptr and len(pool.buffers()) == 2
    assert view.ctypes.data == ptr
