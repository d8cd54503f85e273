"""Transport: for each exchange of a round, choose the strategy the model predicts cheapest."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.collectives.strategies import GLOO_CUDA, NAMES, make_strategies, usable
from conduit_dist.collectives.topology import Topology
from conduit_dist.errors import ConfigError


def check_cuda_strategy(strategy: str, cuda_backend: str) -> None:
    """Refuse forcing a strategy that cannot move a CUDA plane's rows over ``cuda_backend``
    (point-to-point or gather over gloo). A plane checks it before its first collective, and
    its :class:`Transport` again.

    Raises:
        ConfigError: naming the strategy, the backend and what is accepted.
    """
    if strategy != "auto" and strategy not in usable(True, cuda_backend):
        raise ConfigError(
            f"strategy: {strategy!r} cannot move CUDA rows over {cuda_backend} (gloo has no "
            f"send/recv or gather of CUDA tensors); expected 'auto' or one of {list(GLOO_CUDA)} "
            f"on a CUDA plane over gloo, or nccl (CONDUIT_CUDA_BACKEND) for {strategy!r}"
        )


@dataclass
class Move:
    """One exchange as it happened: strategy, predicted and measured milliseconds."""

    op: str
    strategy: str
    predicted_ms: float
    measured_ms: float


class Transport:
    """Runs a round's exchanges with the strategy chosen by the bandwidth model (or forced).

    Args:
        ex: the plane's collectives.
        topo: the job's topology.
        model: the bandwidth model every rank agrees on.
        strategy: ``auto`` or one of the strategy names (forces it).
        device_model: the model of rows on the GPU (calibrated on device tensors); ``None``:
            ``model`` prices them too.

    Raises:
        ConfigError: on an unknown strategy, or one that cannot move the plane's CUDA rows
            (point-to-point or gather with gloo carrying CUDA tensors).

    Rows on the GPU over gloo (``CONDUIT_CUDA_BACKEND=gloo``) move by the fused all-to-all only
    (``strategies.usable``); under ``auto``, host rows of the same plane may take any strategy.
    A forced strategy is refused on any CUDA plane over gloo, whichever device its rounds'
    rows turn out to be on.
    """

    def __init__(
        self,
        ex: Exchange,
        topo: Topology,
        model: BandwidthModel,
        strategy: str = "auto",
        device_model: BandwidthModel | None = None,
    ):
        if strategy != "auto" and strategy not in NAMES:
            raise ConfigError(
                f"strategy: expected 'auto' or one of {list(NAMES)}, got {strategy!r}"
            )
        if ex.cuda is not None:
            check_cuda_strategy(strategy, ex.cuda_backend)
        self.ex, self.topo, self.model, self.forced = ex, topo, model, strategy
        # rows on the GPU are priced by the model calibrated on device tensors, where there is
        # one (a plane whose bulk rows go by NCCL); else by the host rows' model
        self.device_model = device_model if device_model is not None else model
        self.links = topo.link_matrix()
        self.strategies = make_strategies()
        self._choices: dict[bytes, tuple[str, float]] = {}

    def choose(self, matrix_bytes: np.ndarray, on_cuda: bool = False) -> tuple[str, float]:
        """Strategy and predicted seconds for a byte matrix of host or (``on_cuda``) GPU rows
        (memoised per matrix and device)."""
        key = matrix_bytes.tobytes() + bytes([on_cuda])
        hit = self._choices.get(key)
        if hit is None:
            model = self.device_model if on_cuda else self.model
            if self.forced != "auto":
                hit = (self.forced, model.predict(self.forced, matrix_bytes, self.links))
            else:
                allowed = usable(True, self.ex.cuda_backend) if on_cuda else None  # host: any
                hit = model.choose(matrix_bytes, self.links, allowed)
            if len(self._choices) > 1024:
                self._choices.clear()
            self._choices[key] = hit
        return hit

    def lands(self, matrix_bytes: np.ndarray) -> bool:
        """Whether the host move of ``matrix_bytes`` (``[src, dst]`` bytes, one-byte rows) will
        go through the exchange's shared memory, where :meth:`land` can place what this rank
        receives run by run."""
        if self.ex.shm is None or self.ex.world == 1:
            return False
        return self.choose(matrix_bytes)[0] == "all_to_all"  # the same choice move() makes

    def land(self, spans: dict[int, np.ndarray]) -> None:
        """Have the next move (one that :meth:`lands`) copy the rows it receives from each
        source straight to ``spans``' addresses (``SharedMemory.land``) instead of into its
        ``out``; no other exchange may run in between."""
        self.ex.land(spans)

    def lend(self, matrix_bytes: np.ndarray) -> torch.Tensor | None:
        """This rank's send bytes of the host move of ``matrix_bytes`` (``[src, dst]`` bytes, a
        ``move`` of one-byte rows), lent by the exchange's shared memory where the move will
        go through it (the ``all_to_all`` strategy on an exchange with shared memory): written
        there, they are not copied again. ``None`` where it will not, or where there is nothing
        to send: use a buffer of your own. No other exchange may run between the lend and the
        move (the lent half is the next exchange's); a writer that fails calls
        :meth:`unlend`."""
        if not self.lands(matrix_bytes):
            return None
        lent = self.ex.send_rows(int(matrix_bytes[self.ex.rank].sum()), 1)
        return None if lent is None else lent[0].view(-1)

    def unlend(self) -> None:
        """Give back what :meth:`lend` lent, unused (its writer failed)."""
        self.ex.unlend()

    def move(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        rows: np.ndarray,
        round: int,
        op: str,
    ) -> Move:
        """Move record rows: ``rows[src, dst]`` (the same on every rank) of ``width`` bytes."""
        me = self.ex.rank
        width = inp.shape[1] * inp.element_size() if inp.dim() == 2 else 1
        name, pred = self.choose(rows * width, inp.is_cuda or out.is_cuda)
        t0 = time.perf_counter()
        self.strategies[name].run(
            self.ex, out, inp, rows[:, me].tolist(), rows[me].tolist(), round, op, rows
        )
        return Move(op, name, pred * 1e3, (time.perf_counter() - t0) * 1e3)
