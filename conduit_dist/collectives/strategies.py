"""Ways to move one round's record rows between ranks; all produce what ``all_to_all_single`` does.

Every strategy takes the same arguments: ``out`` (rows received, grouped by source rank in rank
order, ``out_splits`` rows from each), ``inp`` (rows to send, grouped by destination,
``in_splits`` rows to each), and must be called by every rank of the plane's group with a byte
matrix every rank agrees on. The choice among them is made by the bandwidth model (``model.py``).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.collectives.exchange import Exchange


def _offsets(splits: list[int]) -> list[int]:
    return [0, *itertools.accumulate(splits)]


class Strategy(ABC):
    """One way to run a round's exchange."""

    name: str = "abstract"

    @abstractmethod
    def run(
        self,
        ex: Exchange,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        round: int,
        op: str,
        matrix: np.ndarray,
    ) -> None:
        """Move the rows (a collective over the plane's group).

        ``matrix[src, dst]`` is the number of rows every rank sends to every rank (the same on
        every rank).
        """


class FusedAllToAll(Strategy):
    """One ``all_to_all_single`` for everything (the default on small, dense byte matrices)."""

    name = "all_to_all"

    def run(self, ex, out, inp, out_splits, in_splits, round, op, matrix):
        ex.all_to_all(out, inp, out_splits, in_splits, round, f"{op}[all_to_all]")


class PointToPoint(Strategy):
    """Batched ``isend``/``irecv`` to the peers that have rows only (skips empty pairs).

    Args:
        pieces: split each peer's rows into this many messages (a pipelined variant).
    """

    def __init__(self, pieces: int = 1) -> None:
        self.pieces = pieces
        self.name = "p2p" if pieces == 1 else f"chunked{pieces}"

    def _ranges(self, start: int, rows: int) -> list[tuple[int, int]]:
        k = max(1, min(self.pieces, rows))
        edges = [start + rows * i // k for i in range(k + 1)]
        return [(a, b) for a, b in itertools.pairwise(edges) if b > a]

    def run(self, ex, out, inp, out_splits, in_splits, round, op, matrix):
        me = ex.rank
        o_off, i_off = _offsets(out_splits), _offsets(in_splits)
        out[o_off[me] : o_off[me + 1]].copy_(inp[i_off[me] : i_off[me + 1]])
        if ex.world == 1:
            return
        ops = []
        group = ex.group
        for peer in range(ex.world):
            if peer == me:
                continue
            for a, b in self._ranges(i_off[peer], in_splits[peer]):
                ops.append(dist.P2POp(dist.isend, inp[a:b], peer, group))
            for a, b in self._ranges(o_off[peer], out_splits[peer]):
                ops.append(dist.P2POp(dist.irecv, out[a:b], peer, group))
        if ops:  # waited once each, with the full timeout: a gloo send/recv's timed wait that
            # expires closes the group's pairs (Exchange.send_recv)
            ex.send_recv(ops, f"{op}[{self.name}]", round, inp.is_cuda)


class GatherToOwner(Strategy):
    """One ``gather`` per destination that receives rows; chunks padded to the largest.

    Cheap when one destination receives almost everything (one hot learner); wasteful otherwise.
    """

    name = "gather"

    def __init__(self) -> None:
        self._pad: torch.Tensor | None = None
        self._recv: list[torch.Tensor] = []

    def run(self, ex, out, inp, out_splits, in_splits, round, op, matrix):
        world, me = ex.world, ex.rank
        i_off, o_off = _offsets(in_splits), _offsets(out_splits)
        width = inp.shape[1] if inp.dim() == 2 else out.shape[1]
        for dst in range(world):
            biggest = int(matrix[:, dst].max())
            if biggest == 0:
                continue
            mine = inp[i_off[dst] : i_off[dst + 1]]
            send = self._buffer(biggest, width, inp.dtype, inp.device)
            send[: mine.shape[0]].copy_(mine)
            recv = self._recv_buffers(world, biggest, width, out) if me == dst else None
            ex.gather(send, recv, dst, round, f"{op}[gather]")
            if me == dst:
                for src in range(world):
                    n = out_splits[src]
                    out[o_off[src] : o_off[src] + n].copy_(recv[src][:n])

    def _recv_buffers(self, world: int, rows: int, width: int, like: torch.Tensor) -> list:
        """Reused receive buffers (fresh memory costs a page fault per page on every call)."""
        bufs = self._recv
        if len(bufs) != world or bufs[0].shape[0] < rows or bufs[0].shape[1] != width:
            self._recv = [
                torch.empty((rows, width), dtype=like.dtype, device=like.device)
                for _ in range(world)
            ]
        return [b[:rows] for b in self._recv]

    def _buffer(self, rows: int, width: int, dtype, device) -> torch.Tensor:
        if self._pad is None or self._pad.shape[0] < rows or self._pad.shape[1] != width:
            self._pad = torch.empty((rows, width), dtype=dtype, device=device)
        return self._pad[:rows]


def make_strategies() -> dict[str, Strategy]:
    """One instance of every strategy (per plane: strategies keep scratch buffers)."""
    return {s.name: s for s in (FusedAllToAll(), PointToPoint(1), PointToPoint(4), GatherToOwner())}


NAMES = tuple(make_strategies())

# gloo carries CUDA tensors through all_to_all but has no send/recv or gather for them (its
# sockets would be handed device pointers): only the fused collective moves rows on the GPU there
GLOO_CUDA = ("all_to_all",)


def usable(on_cuda: bool, cuda_backend: str) -> tuple[str, ...]:
    """The strategies that can move rows of one device through a group.

    Args:
        on_cuda: whether the rows are CUDA tensors.
        cuda_backend: the backend that carries the group's CUDA tensors
            (``Exchange.cuda_backend``: ``"nccl"``, ``"gloo"``, or ``""`` at world size 1).

    Returns:
        :data:`NAMES`, or :data:`GLOO_CUDA` for CUDA rows over gloo.
    """
    return GLOO_CUDA if on_cuda and cuda_backend == "gloo" else NAMES
