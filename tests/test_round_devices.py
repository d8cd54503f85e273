"""Where a round composes its rows, which schedule runs, and how rows land on the learner's
device: every sampler delivers to CUDA, composed on the GPU where everything the round touches is
there, else on the host and landed (``rounds.engine.round_devices``, ``rounds.delivery.Landing``).

These are the decisions; no GPU is needed to check them (``torch.device("cuda", 0)`` is a plain
value). The copies themselves run in ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import pytest
import torch

import conduit_dist as cd
from conduit_dist.records.buffers import OutputPool
from conduit_dist.rounds.delivery import Landing
from conduit_dist.rounds.devices import round_devices, rows_on_host
from conduit_dist.rounds.wire import _RecvPool

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)

HOST_ROWS = {  # sampler -> composes or reports on the host
    "uniform": (lambda: cd.Uniform(), False),
    "stratified": (lambda: cd.Stratified(), False),
    "queue": (lambda: cd.Fifo(), False),
    "lifo": (lambda: cd.Lifo(), False),
    "without_replacement": (lambda: cd.WithoutReplacement(), False),
    "prioritized": (lambda: cd.Prioritized(), True),
    "n_step": (lambda: cd.Prioritized(sequence=cd.Windows(n_step=3, stream="env")), True),
}


@pytest.mark.parametrize("kind", sorted(HOST_ROWS))
def test_rows_on_host_follows_the_samplers_capabilities(kind):
    make, host = HOST_ROWS[kind]
    assert rows_on_host(make(), 0) is host
    assert rows_on_host(make(), 4) is True  # a reduce payload rides host headers


def test_cpu_planes_keep_the_schedules_they_had():
    for sync in (True, False):
        assert round_devices(1, True, CPU, CPU, False, sync) == ("local", CPU)
        assert round_devices(2, True, CPU, CPU, True, sync) == ("fused", CPU)
        assert round_devices(2, False, CPU, CPU, False, sync) == ("general", CPU)


def test_gpu_rows_only_where_everything_the_round_touches_is_on_the_gpu():
    # storage on the learner's GPU, a sampler with no host work, rounds on fetch's thread
    assert round_devices(2, False, GPU, GPU, False, True) == ("general", GPU)
    assert round_devices(2, True, GPU, GPU, False, True) == ("general", GPU)
    assert round_devices(1, True, GPU, GPU, False, False) == ("local", GPU)  # no collective
    # host work (prioritized trees, windows, headers): composed on the host, landed
    assert round_devices(2, True, GPU, GPU, True, True) == ("fused", CPU)
    assert round_devices(2, False, GPU, GPU, True, True) == ("general", CPU)
    assert round_devices(1, True, GPU, GPU, True, True) == ("local", CPU)
    # storage on the host (or on another GPU)
    assert round_devices(2, False, GPU, CPU, False, True) == ("general", CPU)
    assert round_devices(2, False, GPU, torch.device("cuda", 1), False, True)[1] == CPU


def test_overlapped_rounds_never_enqueue_nccl_from_the_worker_thread():
    """Above one rank, a round on the overlap worker moves host rows over gloo: the plane's
    NCCL kernels are only ever enqueued by the thread that calls fetch, in program order with
    the caller's own (DDP's), so two communicators never meet in different orders."""
    for keeps_local in (True, False):
        schedule, rows = round_devices(4, keeps_local, GPU, GPU, False, False)
        assert rows == CPU
        assert schedule == ("fused" if keeps_local else "general")


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
    copy that last read it (an object with ``synchronize`` stands for the CUDA event here)."""
    pool = OutputPool(16, CPU, lambda r: {"x": r})
    first = pool.acquire(4)
    waited = []

    class Event:
        def synchronize(self):
            waited.append(True)

    pool.read_by(first, Event())
    del first
    again = pool.acquire(4)
    assert waited == [True]
    del again
    pool.acquire(4)
    assert waited == [True]  # once: the event is cleared after the wait


def test_a_started_round_runs_both_halves_on_the_side_stream(monkeypatch):
    """``fetch_start``'s half of a round (donated puts packed, the local ingest into a device
    tier, the header launch) is enqueued on the round's side stream, after the ticket's event,
    like its finish: on the consumer's stream the finish's gathers and its end event would not
    be ordered after those copies. Fake stream and events stand for CUDA's here."""
    from types import SimpleNamespace

    from conduit_dist.rounds.tickets import RoundStats, RoundTicket
    from conduit_dist.sched.scheduler import Scheduler

    seen = []

    class Stream:
        current = False

        def wait_event(self, event):
            seen.append(("wait", event))

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
        delivery = SimpleNamespace(outputs=SimpleNamespace(consumer=None))

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
