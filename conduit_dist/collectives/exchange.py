"""The data plane's collectives: one group, a timeout on every call, failures that name ranks.

All experience movement goes through an :class:`Exchange`. It owns a process group dedicated to the
plane (so rounds never interleave with the learner's own DDP all-reduces, even when a round runs on
a background thread), waits on every collective with a timeout, and on failure raises a
:class:`~conduit_dist.errors.RoundError` naming the round, the operation and, where the rendezvous
store can still tell, the ranks that never reached that round (``heartbeats.py``). Collectives
outside the rounds (start-up, metrics) run inside a named :meth:`Exchange.phase` and fail the
same way, with a :class:`~conduit_dist.errors.PhaseError` naming the phase.

The group's backend is chosen, not copied (``dist.plane_backend``): ``gloo`` on a CPU plane,
``cpu:gloo,cuda:nccl`` (or ``cuda:gloo``) where CUDA tensors pass through it. On a group with
NCCL, a round's NCCL works are ordered on the device (``work.wait()`` on the round's side stream)
and checked without blocking at later rounds against the plane's deadline; start-up's poll on the
host (``heartbeats.wait_polling``); the NCCL communicator is created during construction, by one
warm-up collective.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.collectives.dist import (
    backend_for,
    backends_of,
    chosen_cuda_backend,
    cuda_backend_of,
    plane_group,
    resolve_device,
    uses_cuda,
)
from conduit_dist.collectives.heartbeats import Heartbeats, _default_store, wait_gloo, wait_polling
from conduit_dist.collectives.pending import PendingGather, PendingWork
from conduit_dist.collectives.shm import SharedMemory
from conduit_dist.collectives.shm_open import open_shared
from conduit_dist.errors import PhaseError, RoundError

T = TypeVar("T")

_HB_PREFIX = "conduit_dist/hb/"


def lazy_marks(group_backend: str, cuda: bool) -> bool:
    """Whether a round's wait on a work of this group marks the heartbeat lazily: only once it
    outlasts a 50 ms grace, or fails (``heartbeats.wait_gloo``). Where gloo carries the tensors
    (host tensors of a ``cpu:gloo,cuda:nccl`` group too; shared memory's waits behave the
    same), a collective's timed ``wait`` can give up and be waited on again. An NCCL work is
    polled (``heartbeats.wait_polling``), and its wait marks before it polls. Gloo's send/recv
    works are the exception on any group: an expired timed wait closes the group's pairs, so
    they are marked first and waited once (:meth:`Exchange.send_recv`).

    Every round's first collective is the meta or header exchange of host tensors, so on the
    package's groups a round writes the store only where a wait outlasts the grace or fails,
    or at its first NCCL wait.

    Args:
        group_backend: the group's backend string (``""``: no group, world size 1).
        cuda: whether the work's tensors are on the GPU.

    Returns:
        ``True`` for a lazy mark.

    Example::

        lazy_marks("cpu:gloo,cuda:nccl", cuda=False)  # True: the meta exchange
        lazy_marks("cpu:gloo,cuda:nccl", cuda=True)  # False: NCCL
    """
    return not group_backend or backend_for(group_backend, cuda) == "gloo"


# the likely cause when a rank is named as late for a round
SKIPPED = (
    "a rank that crashed shows its own error; one that is alive skipped the round: every rank "
    "runs one round per fetch (learners) or flush (actors), so a rank that only puts, e.g. "
    "during a warm-up, must call flush() as often as its peers fetch"
)


class Exchange:
    """Collectives of one data plane, with timeouts and per-round heartbeats.

    Args:
        timeout_s: seconds any single collective may take before the round fails.
        group: an existing process group to use; by default a new group over all ranks is created
            (a collective call: every rank must construct its Exchange at the same point).
        name: prefix of the heartbeat keys, unique per plane.
        device: the plane's device: whether CUDA tensors pass through the new
            group (``dist.uses_cuda``) and on which device.
        shared_memory: all-to-alls of host tensors through ``/dev/shm`` (every rank on one
            host; checked at construction), not gloo's sockets (``collectives/shm.py``).
            ``True``/``False``/``"auto"``: every rank says which at construction (a plane's
            exchange; ranks that differ are refused by rank; ``"auto"``: on where every rank
            is on one host with room, ``shm_open.open_shared``); ``None``: off, nothing agreed.

    The new group's backend is ``dist.plane_backend`` of that: ``gloo``, or
    ``cpu:gloo,cuda:<dist.chosen_cuda_backend()>``. With NCCL, construction runs one warm-up
    collective on a CUDA tensor (see :meth:`_warm_up`).

    Without a process group under plain ``python`` (no ``RANK``/``WORLD_SIZE``) it is a
    one-rank exchange that runs no collective, so a world-size-1 plane needs no set-up.

    Raises:
        RuntimeError: under torchrun without a process group (call ``init_distributed``).
        ConfigError: CUDA in use on a machine without it, a bad ``CONDUIT_CUDA_BACKEND``, or
            ``shared_memory`` with ranks that do not share rank 0's ``/dev/shm``.
        PhaseError: if the NCCL warm-up fails or times out (naming the ranks that never came).

    Example::

        ex = Exchange(60.0)
        with ex.phase("start-up: discover hosts"):
            ex.run(lambda: dist.all_reduce(t, group=ex.group, async_op=True), "all_reduce(t)")
    """

    def __init__(
        self,
        timeout_s: float,
        group: dist.ProcessGroup | None = None,
        name: str = "0",
        *,
        device: str | torch.device = "cpu",
        shared_memory: bool | str | None = None,
    ):
        self.timeout = timedelta(seconds=timeout_s)
        self.shm: SharedMemory | None = None  # host all-to-alls through /dev/shm (shm.py)
        if dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        elif "RANK" in os.environ or "WORLD_SIZE" in os.environ:
            raise RuntimeError(
                "no process group: call conduit_dist.init_distributed() first (under torchrun: "
                f"RANK={os.environ.get('RANK')}, WORLD_SIZE={os.environ.get('WORLD_SIZE')})"
            )
        else:  # plain python, world size 1: nothing to exchange, no group needed
            self.rank, self.world = 0, 1
        self.group = group
        # the CUDA device whose tensors pass through the group (None: CPU tensors only)
        self.cuda: torch.device | None = None
        if group is None and self.world > 1:
            if uses_cuda(device):  # resolved before any group exists: errors leave none
                self.cuda = resolve_device(device)
            self.group = plane_group(self.timeout, self.cuda, chosen_cuda_backend())
        # a group given at world size 1 (e.g. a one-rank NCCL group) is read too
        backend = str(dist.get_backend(self.group)) if self.group is not None else ""
        kinds = backends_of(backend)
        # the backend CUDA tensors go through ("": none between ranks); gloo has all-to-all,
        # broadcast and all-reduce for them but no send/recv or gather (strategies.usable)
        self.cuda_backend = cuda_backend_of(backend) if backend else ""
        # {cuda: whether waits on such tensors mark lazily}: a gloo collective's work.wait(t)
        # raises when t expires and can be waited on again, so its marks can wait (lazy_marks;
        # not send/recv works: send_recv)
        self._lazy = {cuda: lazy_marks(backend, cuda) for cuda in (False, True)}
        self._marked = -1  # the latest round this rank marked
        # rounds' NCCL works ordered on the device, not yet seen completed (_on_device)
        self._device_works: list[tuple[dist.Work, str, int, float]] = []
        self._barrier_token = torch.zeros(1, dtype=torch.int32)  # a host value: gloo's
        # NCCL's work.wait() bounds nothing on the host: every wait of the group polls instead
        self._poll = "nccl" in kinds
        store, missing = _default_store() if self.world > 1 else (None, "")
        self._beats = Heartbeats(store, f"{_HB_PREFIX}{name}/", self.rank, self.world, missing)
        self._phase: tuple[str, int] | None = None  # (name, sequence number) of the open phase
        self._phases = 0  # phases entered so far (the same sequence on every rank)
        self._gather_bufs: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._a2a_opts = dist.AllToAllOptions()
        # set to a list to record (op, bytes sent per peer, bytes received per peer) of every
        # all-to-all (benchmarks replay them raw); None: nothing recorded
        self.record: list[tuple[str, list[int], list[int]]] | None = None
        if self._poll and self.cuda is not None:
            # NCCL creates a communicator at its group's first CUDA collective. Left to the first
            # round, that is on the round's worker thread (overlap schedules), under its current
            # device, inside the round's timeout, while DDP's NCCL work may run on the learner's
            # thread: a blocking rendezvous of every rank that must not interleave with other
            # NCCL calls. One all-reduce here creates it on the constructing thread, where every
            # rank is by contract (creating the group was collective too), on the plane's
            # device; a rank that never comes fails start-up by name.
            try:
                self._warm_up()
            except BaseException:
                self.close()
                raise
        if shared_memory is not None and self.world > 1:  # a plane's: every rank says
            try:
                with self.phase("start-up: shared memory"):
                    self.shm = open_shared(self, shared_memory)
            except BaseException:
                self.close()
                raise

    def _warm_up(self) -> None:
        """One all-reduce of a CUDA tensor as the phase ``start-up: NCCL communicator``."""
        probe = torch.zeros(1, device=self.cuda)
        with torch.cuda.device(self.cuda), self.phase("start-up: NCCL communicator"):
            self.run(
                lambda: dist.all_reduce(probe, group=self.group, async_op=True),
                "all_reduce(NCCL warm-up)",
                cuda=True,
            )

    def heartbeat(self, round: int) -> None:
        """Record in the rendezvous store that this rank has reached ``round`` (once a round)."""
        if round != self._marked:
            self._marked = round
            self._beats.mark("round", round)

    def arrive(self, round: int) -> None:
        """A round starts on this rank. Its first wait is on host tensors (the meta or header
        exchange): where gloo or shared memory carries them, the mark is written only once a
        wait outlasts a 50 ms grace or fails, and an NCCL wait marks before it polls
        (:func:`lazy_marks`); a rank blocked in ``round`` has marked it long before any
        timeout, a rank that never arrived has not, so failures still name it. Elsewhere the
        mark is written now."""
        if self._device_works:  # the earlier rounds' NCCL works: done, or late by now?
            self.check_device_works()
        if not self._lazy[False]:
            self.heartbeat(round)

    def laggards(self, round: int) -> tuple[int, ...]:
        """Ranks whose last heartbeat is older than ``round`` (empty if the store cannot tell)."""
        return self._beats.behind("round", round)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run collectives outside the rounds (start-up, metrics) as the phase ``name``.

        Entering records this rank's arrival in the rendezvous store. A collective inside that
        fails or times out raises :class:`~conduit_dist.errors.PhaseError` naming the phase, this
        rank, the timeout and the ranks that never entered the phase. Every rank must enter the
        same phases in the same order (as it must call the same collectives). Phases nest: the
        innermost one is named.
        """
        self._phases += 1
        self._beats.mark("phase", self._phases)
        outer, self._phase = self._phase, (name, self._phases)
        try:
            yield
        finally:
            self._phase = outer

    def run(
        self, launch: Callable[[], dist.Work | None], op: str, round: int = -1, cuda: bool = False
    ) -> None:
        """Launch one collective (``async_op=True``) and wait for it with the timeout.

        Args:
            launch: starts the collective on :attr:`group` and returns its work.
            op: the operation's name in errors, e.g. ``"all_reduce(metrics)"``.
            round: the round it belongs to; ``-1`` outside the rounds (in the open phase).
            cuda: its tensors are on the GPU (its work is NCCL's where the group has NCCL).

        Raises:
            RoundError: when it fails or times out in a round; :class:`PhaseError` outside one.
        """
        self.wait_all(lambda: [launch()], op, round, cuda)

    def barrier(self, op: str, round: int = -1) -> None:
        """A barrier over :attr:`group`, with the timeout (nothing to wait for at world size 1).

        It is an all-reduce of one host value, so gloo runs it on every group: torch's
        ``dist.barrier`` goes to NCCL on a group bound to a device (a CUDA plane's), where it
        would synchronise the caller's stream with no timeout, from whatever thread calls it.
        """
        if self.world == 1:
            return
        token = self._barrier_token
        self.run(
            lambda: dist.all_reduce(token, group=self.group, async_op=True), f"barrier({op})",
            round,
        )  # fmt: skip

    def _wait(
        self,
        work: dist.Work | None,
        op: str,
        round: int,
        cuda: bool = False,
        rewaitable: bool = True,
    ) -> None:
        """Wait for ``work`` until the timeout: a round's NCCL work (``cuda`` on a group with
        NCCL) is ordered on the device and checked later (:meth:`_on_device`); an NCCL work
        outside the rounds (start-up) is polled (``wait_polling``: NCCL's own ``wait()`` bounds
        nothing on the host); a gloo work (or shared memory's) is waited with gloo's
        ``wait(timeout)``, marking the heartbeat only if the wait outlasts a grace
        (``wait_gloo``). ``rewaitable=False`` (gloo's send/recv works, :meth:`send_recv`): a
        timed wait that expires closes the group's pairs, so there is no grace: the heartbeat
        is marked first and the work waited once, with the full timeout."""
        if work is None:
            return
        start = time.monotonic()
        if self._poll and cuda and round >= 0:  # a round's NCCL work: ordered on the device
            self._on_device(work, op, round, start)
            return
        lazy = self._lazy[cuda] and rewaitable
        if round >= 0 and not lazy:
            self.heartbeat(round)  # e.g. before polling an NCCL work (once a round)
        mark = (lambda: self.heartbeat(round)) if lazy and round >= 0 else None
        try:
            if self._poll and cuda:
                done = wait_polling(work, start + self.timeout.total_seconds())
            else:
                done = wait_gloo(work, self.timeout, mark)
        except Exception as exc:
            self._fail(op, round, start, exc)
        if not done:
            self._fail(op, round, start, None)

    def _on_device(self, work: dist.Work, op: str, round: int, start: float) -> None:
        """A round's NCCL work is not waited on the host: ``work.wait()`` makes the current
        stream (the round's side stream) wait for it on the device and returns at once, so a
        microsecond collective costs no host poll and queued kernels ahead of it (a backward)
        are not waited for. Its completion is checked without blocking at each later round's
        start (:meth:`check_device_works`): one still running after the timeout fails that
        round by name, before NCCL's watchdog (``dist.watchdog_timeout``) ends the process."""
        try:
            work.wait()
        except Exception as exc:
            self._fail(op, round, start, exc)
        self._device_works.append((work, op, round, start))

    def check_device_works(self) -> None:
        """Forget the rounds' NCCL works that completed (one query each, never blocking).

        Raises:
            RoundError: naming the round and operation of one that is still running after the
                timeout, and the ranks whose heartbeat is older.
        """
        now = time.monotonic()
        keep, deadline = [], now - self.timeout.total_seconds()
        for work, op, round, start in self._device_works:
            if work.is_completed():
                continue
            if start < deadline:
                self._device_works = []
                if self.shm is not None and self.shm.broken is None:
                    self.shm.broken = f"an earlier collective of the plane failed ({op})"
                # the heartbeats cannot tell who is late here: they are written lazily, by
                # waits on the host, and every rank went on past this round on the host
                raise RoundError(
                    f"round {round}: {op} has not completed on the device after "
                    f"{now - start:.1f}s on rank {self.rank} (timeout "
                    f"{self.timeout.total_seconds():g}s); failing rank unknown (a peer that "
                    f"died or left its round shows its own error)",
                    round=round,
                )
            keep.append((work, op, round, start))
        self._device_works = keep

    def _fail(self, op: str, round: int, start: float, exc: BaseException | None) -> None:
        if self.shm is not None and self.shm.broken is None:  # no later exchange may run on it
            where = f" in round {round}" if round >= 0 else ""
            self.shm.broken = f"an earlier collective of the plane failed ({op}{where})"
        waited = time.monotonic() - start
        cause = f": {exc}" if exc is not None else ""
        how = (
            f"failed on rank {self.rank} after {waited:.1f}s "
            f"(timeout {self.timeout.total_seconds():g}s)"
        )
        if round >= 0:
            # this rank got here (a lazy mark may be unwritten: a peer's crash fails a wait at
            # once); a no-op where it was marked already
            self.heartbeat(round)
            late = self.laggards(round)
            who = (
                f"ranks {list(late)} never reached round {round} ({SKIPPED})"
                if late
                else "failing rank unknown"
            )
            raise RoundError(
                f"round {round}: {op} {how}; {who}{cause}", round=round, ranks=late
            ) from exc
        name, seq = self._phase if self._phase is not None else (op, None)
        late = self._beats.behind("phase", seq) if seq is not None else ()
        who = f"ranks {list(late)} never entered this phase" if late else "failing rank unknown"
        where = f"{name}: {op}" if name != op else op
        raise PhaseError(f"{where} {how}; {who}{cause}", phase=name, ranks=late) from exc

    def all_gather_start(self, local: torch.Tensor, round: int) -> PendingGather:
        """Start gathering a small 1-D tensor from every rank; ``.wait()`` gives ``[world, len]``.

        Runs as an ``all_to_all_single`` of ``local`` repeated per peer: on gloo that is about
        half the latency of ``all_gather_single`` for a few bytes (measured: 0.12 vs 0.25 ms).

        Local work done before ``wait`` (packing, a heartbeat) overlaps the collective's latency.
        The result is a reused buffer, valid until the next gather of the same size.
        Every started gather must be waited on, on every rank, before the next collective.

        Raises:
            RoundError: if the launch fails.
        """
        if self.world == 1:
            return PendingGather(self, None, local.unsqueeze(0).clone(), round)
        # reused buffers: on a loaded 2-core host each small tensor op in a round costs ~4x
        # its idle time, and the meta exchange runs every round
        key = (local.numel(), local.dtype)
        bufs = self._gather_bufs.get(key)
        if bufs is None:
            bufs = self._gather_bufs[key] = (
                torch.empty(self.world * key[0], dtype=key[1]),
                torch.empty(self.world * key[0], dtype=key[1]),
            )
        inp, out = bufs
        inp.view(self.world, -1).copy_(local)
        op = "all_gather(meta)"
        work = self._launch(lambda: self.all_to_all_start(out, inp, [], [], op), op, round)
        return PendingGather(self, work, out.view(self.world, -1), round)

    def all_to_all_start(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        op: str = "all_to_all",
    ) -> dist.Work:
        """Launch ``all_to_all_single`` on the plane's group (splits along dim 0; ``[]``: even).

        Calls the process group's ``alltoall_base`` directly: ``dist.all_to_all_single`` is that
        call behind Python-side checks and logging that cost ~0.04 ms a call here, and the
        plane's buffers are contiguous and of one dtype by construction. Host tensors go
        through shared memory instead where the exchange was built with ``shared_memory``
        (``collectives/shm.py``). Returns the work.
        """
        if self.record is not None:
            sent, got = (
                _split_bytes(inp, in_splits, self.world),
                _split_bytes(out, out_splits, self.world),
            )
            self.record.append((op, sent, got))
        if self.shm is not None and not (out.is_cuda or inp.is_cuda):
            return self.shm.start(out, inp, out_splits, in_splits)
        return self.group.alltoall_base(out, inp, out_splits, in_splits, self._a2a_opts)

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        round: int,
        op: str = "all_to_all",
    ) -> None:
        """Fused ``all_to_all_single`` of record rows (splits in rows along dim 0)."""
        self.all_to_all_async(out, inp, out_splits, in_splits, round, op).wait()

    def all_to_all_async(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        round: int,
        op: str = "all_to_all",
    ) -> PendingWork:
        """Launch :meth:`all_to_all` and return at once; ``.wait()`` (with the timeout) completes
        it. Every launched exchange must be waited on, on every rank, before the next one.

        Raises:
            RoundError: if the launch fails.
        """
        launch = lambda: self.all_to_all_start(out, inp, out_splits, in_splits, op)  # noqa: E731
        work = self._launch(launch, op, round)
        return PendingWork(self, work, op, round, out.is_cuda or inp.is_cuda)

    def wait_all(self, launch, op: str, round: int, cuda: bool = False) -> None:
        """Launch several collectives and wait on each with the timeout (``cuda``: on GPU
        tensors, see :meth:`_wait`). Their timed waits must be re-waitable (gloo's collectives,
        shared memory's); send/recv works go through :meth:`send_recv`."""
        for work in self._launch(launch, op, round):
            self._wait(work, op, round, cuda)

    def send_recv(self, ops: list[dist.P2POp], op: str, round: int, cuda: bool = False) -> None:
        """``batch_isend_irecv(ops)``, then wait on each work with the timeout.

        A gloo send/recv work gets no lazy mark's 50 ms grace: its timed ``wait`` that expires
        is not a retryable timeout (as a collective's is) but closes every pair of the group
        ("Application timeout caused pair closure"), so a merely slow peer would fail the
        round and leave the group unusable. Each work is waited once, with the full timeout,
        the heartbeat marked first (once a round). An NCCL group's works are waited as any
        NCCL work is (:meth:`_wait`).

        Args:
            ops: the sends and receives, on :attr:`group`.
            op: the operation's name in errors, e.g. ``"rows[p2p]"``.
            round: the round it belongs to; ``-1`` outside the rounds.
            cuda: the tensors are on the GPU.

        Raises:
            RoundError: when a send or receive fails or times out (:class:`PhaseError`
                outside a round).
        """
        self.wait_works(self.send_recv_start(ops, op, round), op, round, cuda)

    def send_recv_start(self, ops: list[dist.P2POp], op: str, round: int) -> list[dist.Work]:
        """``batch_isend_irecv(ops)`` without waiting: several batches may be in flight (a
        sender that packs the next piece while the last one moves); wait on them all with
        :meth:`wait_works`."""
        return self._launch(lambda: dist.batch_isend_irecv(ops), op, round)

    def wait_works(self, works: list[dist.Work], op: str, round: int, cuda: bool = False) -> None:
        """Wait on send/recv works as :meth:`send_recv` does (each once, with the timeout)."""
        for work in works:
            self._wait(work, op, round, cuda, rewaitable=False)

    def _launch(self, launch: Callable[[], T], op: str, round: int) -> T:
        """``launch()``; a failure to launch raises as :meth:`_fail` does."""
        start = time.monotonic()
        try:
            return launch()
        except Exception as exc:
            self._fail(op, round, start, exc)

    def gather(
        self, send: torch.Tensor, recv: list[torch.Tensor] | None, dst: int, round: int, op: str
    ) -> None:
        """``gather`` of equal-sized tensors to global rank ``dst``."""
        self.run(
            lambda: dist.gather(send, recv, dst=dst, group=self.group, async_op=True),
            op, round, send.is_cuda,
        )  # fmt: skip

    def broadcast(self, buf: torch.Tensor, src: int, round: int) -> None:
        """Broadcast ``buf`` from global rank ``src``."""
        if self.world == 1:
            return
        self.run(
            lambda: dist.broadcast(buf, src, group=self.group, async_op=True),
            "broadcast(weights)",
            round,
            buf.is_cuda,
        )

    def send_rows(self, rows: int, width: int) -> tuple[torch.Tensor, np.ndarray] | None:
        """Host rows to write the next all-to-all's input into (shared memory's own file: not
        copied again there, ``SharedMemory.send_rows``); ``None``: use a buffer of your own."""
        return self.shm.send_rows(rows, width) if self.shm is not None else None

    def land(self, spans: dict[int, np.ndarray]) -> None:
        """Where the next all-to-all's received rows go, run by run (shared memory only,
        ``SharedMemory.land``).

        Raises:
            RuntimeError: without shared memory (``Transport.lands`` says when it is used).
        """
        if self.shm is None:
            raise RuntimeError("land(): this exchange has no shared memory")
        self.shm.land(spans)

    def unlend(self) -> None:
        """Forget rows :meth:`send_rows` lent that will not be the next all-to-all's input (their
        writer failed before the exchange)."""
        if self.shm is not None:
            self.shm.unlend()

    def close(self, drain: bool = False) -> None:
        """Remove the shared-memory files and destroy the plane's process group (not the
        default one). ``drain``: every rank closes here after the same exchanges (a clean
        close): a barrier first, so that no peer still reads this rank's files."""
        if self.shm is not None:
            try:
                if drain:
                    self.barrier("close (shared memory)")
            finally:
                self.shm.close()
                self.shm = None
        if self.group is not None and self.group is not dist.GroupMember.WORLD:
            with contextlib.suppress(Exception):  # the default group may already be gone
                dist.destroy_process_group(self.group)
            self.group = None


def _split_bytes(t: torch.Tensor, splits: list[int], world: int) -> list[int]:
    """Bytes per peer of an ``all_to_all_single`` buffer (``splits`` along dim 0; ``[]``: even
    over the ``world`` ranks of the plane's group)."""
    total = t.numel() * t.element_size()
    if not splits:
        return [total // world] * world
    row = total // max(t.shape[0], 1)
    return [n * row for n in splits]
