"""Rows composed where they are stored: the host metadata a sampler needs, and nothing else.

On a plane whose rows live on the GPU (``rounds.devices.plan_devices``), a sampler's bookkeeping
stays on the host (a prioritized sampler's sum tree, a window's stream links, an n-step window's
rewards), and the rows themselves never leave the device:

- **Trailers** (an item's address and mass, an n-step row's return and discount) are computed on
  the host and written into the delivered rows' trailer columns with one small non-blocking
  upload per call (:func:`put_words`), after the rows were gathered on the device.
- **Link columns** (``done``, ``truncated``, ``stream``, the n-step ``reward``): a window's
  bookkeeping reads a few bytes of every new record. :class:`ColumnShadow` keeps a host copy of
  just those bytes, one row per slot, written as items are ingested: from the host rows a round
  ingests (staging), or, for rows that only exist on the device (items received from a peer,
  written ahead from CUDA tensors), gathered there and copied to pinned memory without blocking
  (read once their event has passed). A slot the shadow does not hold is read from the storage
  (a counted host sync).

The same code runs on host tensors (a CPU plane rehearsing the device path:
``rounds.devices.REHEARSAL_ENV``), where it is checked byte for byte against the native host
path.
"""

from __future__ import annotations

import numpy as np
import torch

from conduit_dist.records.spec import ExperienceSpec
from conduit_dist.syncs import SYNCS, wait_event
from conduit_dist.tiers.cuda import upload


def put_words(out: torch.Tensor, word: int, values: torch.Tensor) -> None:
    """Write host int64 ``values [n, w]`` into words ``[word, word + w)`` of the rows ``out``.

    Args:
        out: ``uint8 [n, row_bytes]`` rows with contiguous bytes (any device; row bytes and
            offsets are multiples of 8).
        word: the first int64 column.
        values: ``int64 [n, w]`` on the host.

    Into CUDA rows the values go up through pinned memory without a host sync, ordered on the
    current stream (``tiers.cuda.upload``).
    """
    n, w = values.shape
    if n == 0:
        return
    dst = out.view(torch.int64)[:, word : word + w]
    if out.is_cuda:  # CUDA only
        dst.copy_(upload(values, out.device))
    else:
        dst.copy_(values)


def nstep_values(
    rewards: np.ndarray, m: np.ndarray, terminal: np.ndarray, gamma: float
) -> np.ndarray:
    """Each window's n-step return and discount, computed as the native ``seq_nstep`` does
    (float64 sums in the same order, then float32), so both paths give the same bytes.

    Args:
        rewards: ``float32 [k, L]`` the window items' rewards.
        m: ``int64 [k]`` items in each window (1..L).
        terminal: ``bool [k]`` the window's last item is terminal.
        gamma: the discount.

    Returns:
        ``float32 [k, 2]``: ``sum_{j < m} gamma^j r_j`` and ``gamma^m`` (0 when terminal).
    """
    k, L = rewards.shape
    ret = np.zeros(k, dtype=np.float64)
    scale = 1.0
    for j in range(L):
        inside = j < m
        ret = np.where(inside, ret + rewards[:, j].astype(np.float64) * scale, ret)
        scale *= gamma
    disc = np.where(terminal, 0.0, np.power(float(gamma), m.astype(np.float64)))
    out = np.empty((k, 2), dtype=np.float32)
    out[:, 0], out[:, 1] = ret, disc
    return out


def link_spec(spec: ExperienceSpec, names: list[str]) -> ExperienceSpec:
    """The fields ``names`` of ``spec`` as a compact spec of their own (the bytes a sampler's
    host bookkeeping reads of each record)."""
    return ExperienceSpec([spec.fields[n] for n in names])


class ColumnShadow:
    """A host copy of a few columns of every stored record, one row per slot (see the module
    docstring).

    Args:
        spec: the stored records' layout.
        names: the fields kept (their bytes; a compact record of :func:`link_spec`).
        capacity: the shard's capacity (slot ``g % capacity`` holds generation ``g``).
    """

    def __init__(self, spec: ExperienceSpec, names: list[str], capacity: int) -> None:
        self.spec, self.cap = spec, capacity
        self.link = link_spec(spec, names)
        src = np.zeros(self.link.record_bytes, dtype=np.int64)  # compact byte -> stored byte
        for name in names:
            f, at, to = spec.fields[name], spec.offsets[name], self.link.offsets[name]
            src[to : to + f.nbytes] = np.arange(at, at + f.nbytes)
        self._src = src
        self._src_dev: dict[torch.device, torch.Tensor] = {}
        self.table = torch.zeros((capacity, self.link.record_bytes), dtype=torch.uint8)
        self._table = self.table.numpy()
        self.gen = np.full(capacity, -1, dtype=np.int64)  # the generation each row holds
        # device fills not landed yet: (generations, pinned columns, their copy's event)
        self._pending: list[tuple[np.ndarray, torch.Tensor, object]] = []
        self.filled = self.read_back = 0  # rows written by fills; rows read from the storage

    def fill(self, first: int, rows: torch.Tensor) -> None:
        """The records of generations ``first, first + 1, ...`` as ingested (``uint8 [n,
        record_bytes]``, any device): host rows are copied now; CUDA rows' columns are gathered
        on the device and copied to pinned memory on the current stream, read once landed."""
        n = rows.shape[0]
        if n == 0:
            return
        skip = max(0, n - self.cap)  # of more than a ring's worth, the newest stay
        gens = np.arange(first + skip, first + n, dtype=np.int64)
        rows = rows[skip:]
        if rows.is_cpu:
            self._put(gens, rows.numpy()[:, self._src])
            return
        # CUDA only from here, under the rows' device (put's direct writes call this on the
        # caller's thread, whose current device may be another)
        with torch.cuda.device(rows.device):
            src = self._src_dev.get(rows.device)
            if src is None:
                src = self._src_dev[rows.device] = upload(torch.from_numpy(self._src), rows.device)
            cols = rows.index_select(1, src)
            host = torch.empty(cols.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(cols, non_blocking=True)
            event = torch.cuda.current_stream(rows.device).record_event()
        self.gen[gens % self.cap] = -1  # not readable before it lands
        self._pending.append((gens, host, event))

    def _put(self, gens: np.ndarray, cols: np.ndarray) -> None:
        slots = gens % self.cap
        self._table[slots] = cols
        self.gen[slots] = gens
        self.filled += gens.shape[0]

    def land(self) -> None:
        """Write every pending device fill into the table (waiting for its copy if it has not
        finished: a counted host sync)."""
        for gens, host, event in self._pending:
            wait_event(event, "link columns")
            self._put(gens, host.numpy())
        self._pending = []

    def read(self, gens: torch.Tensor, storage) -> np.ndarray:
        """The compact rows of the live items ``gens`` (``int64``, host), ``[n, link bytes]``
        (a new array); slots the shadow does not hold are read from ``storage`` first."""
        self.land()
        g = gens.numpy() if isinstance(gens, torch.Tensor) else np.asarray(gens)
        slots = g % self.cap
        miss = self.gen[slots] != g
        if miss.any():
            lost = np.unique(g[miss])
            rows = torch.empty((lost.shape[0], self.spec.record_bytes), dtype=torch.uint8)
            storage.gather(torch.from_numpy(lost), rows)  # into host memory: landed on return
            if storage.tiers[0].data.is_cuda:
                SYNCS.add("link columns read back")
            self._put(lost, rows.numpy()[:, self._src])
            self.read_back += lost.shape[0]
        return self._table[slots]

    def forget(self) -> None:
        """Forget every row (a restore emptied the shard)."""
        self.gen.fill(-1)
        self._pending = []
