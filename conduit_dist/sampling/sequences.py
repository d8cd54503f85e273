"""Sequences and n-step returns drawn from items stored once: windows that never cross an episode.

A *stream* is what one producer puts in order (one environment of a rank's vector env, named by
an int field of the spec, or the rank itself); its identity is ``(source rank, key)``, so
streams of different ranks that reach one shard (a placement that routes streams) never mix.
Each shard links every item to the previous item of its stream as it arrives (``prev``/``next``
generations; O(window) vectorised work per ingested batch, nothing per stored item), breaking
the link after an item that ends an episode
(``done``, or ``truncated`` when the spec has it). An item becomes a *start* (given the largest
priority, so it can be drawn) once its window is known: the ``length`` (+ ``burn_in``) items
from it are in, none but the last ending an episode; for n-step targets also when an episode
ends sooner (the window stops there). Drawing a start reads its window by following ``next``:
the cost of a draw is the window's, flat in the store's size. Everything is keyed by generation,
so windows are the same across the ring's wrap and the shard's tiers, and an evicted item's
start leaves the store with it.

Delivered rows (built on the shard, in the round):

- slices: ``length + burn_in`` records back to back, returned as ``[B, T, *shape]`` per field
  (the first ``burn_in`` steps are the burn-in);
- n-step: the start item's fields, the last item of its window as ``"_last_<field>"``, and
  ``"_return"`` (``sum_k gamma^k r_k`` over the window), ``"_discount"`` (``gamma^m`` for a
  window of ``m`` items, 0 when its last item is terminal: ``done``) as float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conduit_dist.errors import ConfigError
from conduit_dist.records.buffers import FieldPool, Prefixes
from conduit_dist.records.native import NATIVE_MAX_FIELDS
from conduit_dist.records.spec import _native
from conduit_dist.sampling.device_rows import ColumnShadow, nstep_values

_EMPTY = -(2**63)  # an empty row of the native stream table (INT64_MIN in seq.c)


def _probe(rows: list[list[int]], src: int, key: int) -> int:
    """The row of stream ``(src, key)`` in the native table (as a list of rows), or the empty
    row it goes to (the hash and probing of ``seq_link`` in ``_native/seq.c``)."""
    m64 = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        return z ^ (z >> 31)

    size = len(rows)
    h = mix(((src & m64) * 0x9E3779B97F4A7C15 & m64) ^ (key & m64)) & (size - 1)
    while rows[h][0] != _EMPTY and (rows[h][0] != src or rows[h][1] != key):
        h = (h + 1) & (size - 1)
    return h


@dataclass(frozen=True)
class Windows:
    """Windows a sampler draws instead of single items.

    Args:
        length: items per slice (``T``); 1 with ``n_step > 1``.
        burn_in: items before each slice, delivered with it (slices only).
        n_step: n-step returns over windows of up to ``n_step`` items (1: none).
        gamma: the discount of n-step returns.
        done: bool field marking a terminal item (ends the episode; no bootstrap).
        truncated: bool field marking a truncated episode end (bootstraps); ``None``: none.
        stream: int field naming the producer's stream within a rank (e.g. the env index);
            ``None``: every rank is one stream.
        reward: float32 field summed by n-step returns.

    Raises:
        ConfigError: on a bad length, burn-in, n_step or gamma, or slices with n-step.
    """

    length: int = 1
    burn_in: int = 0
    n_step: int = 1
    gamma: float = 0.99
    done: str = "done"
    truncated: str | None = None
    stream: str | None = None
    reward: str = "reward"

    def __post_init__(self) -> None:
        for field, value in (("length", self.length), ("n_step", self.n_step)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"sequence.{field}: expected an int >= 1, got {value!r}")
        if not isinstance(self.burn_in, int) or self.burn_in < 0:
            raise ConfigError(f"sequence.burn_in: expected an int >= 0, got {self.burn_in!r}")
        if not (isinstance(self.gamma, (int, float)) and 0 <= self.gamma <= 1):
            raise ConfigError(f"sequence.gamma: expected a number in [0, 1], got {self.gamma!r}")
        if self.n_step > 1 and (self.length > 1 or self.burn_in):
            raise ConfigError(
                f"sequence: n_step={self.n_step} draws single items with n-step returns; got "
                f"length={self.length}, burn_in={self.burn_in} too (slices take n_step=1)"
            )

    @property
    def window(self) -> int:
        """Items read per draw."""
        return self.n_step if self.n_step > 1 else self.length + self.burn_in

    def trailer_at(self, record_bytes: int) -> int:
        """Byte offset of a delivered row's trailer: after the window's records (slices) or the
        start and last records (n-step)."""
        return (2 if self.n_step > 1 else self.window) * record_bytes

    def wire_bytes(self, record_bytes: int) -> int:
        """Bytes of one delivered row: the records, then the trailer (address and mass, and for
        n-step the float32 return and discount)."""
        return self.trailer_at(record_bytes) + (24 if self.n_step > 1 else 16)

    def check(self, spec) -> None:
        """Check the named fields against the spec.

        Raises:
            ConfigError: naming the field, the expected and the received dtype.
        """
        want = [(self.done, (torch.bool,), "done")]
        if self.truncated is not None:
            want.append((self.truncated, (torch.bool,), "truncated"))
        if self.stream is not None:
            ints = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
            want.append((self.stream, ints, "stream"))
        if self.n_step > 1:
            want.append((self.reward, (torch.float32,), "reward"))
        for name, dtypes, what in want:
            f = spec.fields.get(name)
            if f is None or f.dtype not in dtypes or f.shape != ():
                got = "no such field" if f is None else f"{f.dtype} {list(f.shape)}"
                raise ConfigError(
                    f"sequence.{what}: expected a scalar {'/'.join(map(str, dtypes))} field "
                    f"{name!r} in the spec, got {got}"
                )


class Episodes:
    """One shard's stream links, episode ends and window reads (see the module docstring).

    Args:
        seq: the windows.
        spec: the stored records' layout.
        storage: the shard (a ``Storage``: ``gather`` by generation).
        gen: the sampler's ``[capacity]`` generation of each leaf (shared, read only here).
        device_rows: the rows stay where they are stored (a GPU): links are made from a host
            copy of the few columns they read (``device_rows.ColumnShadow``, filled as items
            are ingested), and windows are composed by gathers on the rows' device with their
            n-step values computed on the host (:meth:`compose` returns them).
    """

    def __init__(
        self, seq: Windows, spec, storage, gen: torch.Tensor, device_rows: bool = False
    ) -> None:
        seq.check(spec)
        self.seq, self.spec, self.storage, self.gen = seq, spec, storage, gen
        names = [seq.done, *(n for n in (seq.truncated, seq.stream) if n is not None)]
        if seq.n_step > 1:
            names.append(seq.reward)
        self.shadow = ColumnShadow(spec, names, storage.capacity) if device_rows else None
        # the records linking reads: stored rows, or the shadow's compact ones
        self._link = self.shadow.link if device_rows else spec
        self._gen_np = gen.numpy()  # the same memory (the sampler never replaces it)
        cap = storage.capacity
        self.prev = torch.full((cap,), -1, dtype=torch.int64)
        self.next = torch.full((cap,), -1, dtype=torch.int64)
        self.end = torch.zeros(cap, dtype=torch.bool)  # ends an episode (done or truncated)
        self.term = torch.zeros(cap, dtype=torch.bool)  # terminal (done)
        self.src = torch.full((cap,), -1, dtype=torch.int32)  # the rank that put each item
        self.rb = spec.record_bytes
        self._rows = torch.empty((0, self.rb), dtype=torch.uint8)
        # what unpack copies out of an n-step row natively (None: the torch path), where the
        # extension has it and the outputs fit its table
        outputs = self._n_step_outputs() if seq.n_step > 1 else None
        fits = outputs is not None and len(outputs[0]) <= NATIVE_MAX_FIELDS
        self._outputs = outputs if fits and hasattr(_native, "unpack_rows") else None
        if self._outputs is not None:  # the learner's n-step fields, pooled (no per-fetch tensors)
            names, dtypes, shapes = self._outputs[:3]
            self._fields = FieldPool(list(zip(names, dtypes, shapes, strict=True)))
        self._scratch: dict[str, Prefixes] = {}  # per-round index work, reused
        self._arrivals: list[np.ndarray] = []  # sources of items not linked yet, in order
        # the fields linking reads, as (byte offset, kind) in a link record for the native loop
        off = self._link.offsets
        self._off_done = off[seq.done]
        self._off_trunc = off[seq.truncated] if seq.truncated else -1
        self._off_stream, self._kind = -1, 8
        if seq.stream is not None:
            dt = spec.fields[seq.stream].dtype
            self._off_stream = off[seq.stream]
            self._kind = 17 if dt == torch.uint8 else dt.itemsize
        self._off_reward = spec.offsets[seq.reward] if seq.n_step > 1 else -1  # stored rows
        # each stream's newest generation: a dict on the torch path; natively an open-address
        # table (source, key, newest) rows, INT64_MIN: empty
        self.last: dict[tuple[int, int], int] = {}
        self._tab = torch.full((16, 3), _EMPTY, dtype=torch.int64)
        self._tab_used = 0

    def reset(self) -> None:
        """Forget every item and stream (a restore empties the shard)."""
        for t in (self.prev, self.next, self.src):
            t.fill_(-1)
        self.end.fill_(False)
        self.term.fill_(False)
        self._arrivals = []
        self.forget_streams()
        if self.shadow is not None:
            self.shadow.forget()

    def forget_streams(self) -> None:
        """Forget every stream's newest item: the next item of each starts a new stream."""
        self.last = {}
        self._tab.fill_(_EMPTY)
        self._tab_used = 0

    def streams(self) -> dict[tuple[int, int], int]:
        """``(source, key) -> newest generation`` of every stream seen."""
        if _native is None:
            return dict(self.last)
        t = self._tab[self._tab[:, 0] != _EMPTY]
        return {(int(a), int(b)): int(c) for a, b, c in t.tolist()}

    def _set_streams(self, last: dict[tuple[int, int], int], room: int) -> None:
        """Set the streams, with table room for ``room`` more (natively: the table holds them,
        ``last`` stays empty)."""
        if _native is None:
            self.last = dict(last)
            return
        need = 2 * (len(last) + room)
        size = max(16, 1 << (need - 1).bit_length())
        self._tab = torch.full((size, 3), _EMPTY, dtype=torch.int64)
        self._tab_used = 0
        if last:
            rows = self._tab.tolist()
            for (src, key), g in last.items():
                rows[_probe(rows, src, key)] = [src, key, g]
            self._tab = torch.tensor(rows, dtype=torch.int64)
            self._tab_used = len(last)

    def keys(self, records: torch.Tensor) -> torch.Tensor:
        """``int64 [n]``: each record's stream key within its rank (the ``stream`` field or 0)."""
        if self.seq.stream is None:
            return torch.zeros(records.shape[0], dtype=torch.int64)
        return self.spec.unpack(records)[self.seq.stream].to(torch.int64)

    def arrived(self, sources: np.ndarray) -> None:
        """``[world]`` how many of the next new items (in arrival order) each rank sent."""
        counts = np.ascontiguousarray(sources, dtype=np.int64)
        self._arrivals.append(np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts))

    def arrived_items(self, sources: torch.Tensor) -> None:
        """The source rank of each of the next new items (a restored piece's)."""
        self._arrivals.append(sources.to(torch.int64).cpu().numpy())

    def sources_of(self, gens: torch.Tensor) -> torch.Tensor:
        """The rank that put each live item ``gens``."""
        return self.src[gens % self.storage.capacity].clone()

    def _sources(self, n: int) -> torch.Tensor:
        """Sources of the ``n`` newest arrivals (older ones the ring overwrote are dropped;
        items with no recorded arrival count as source -1)."""
        got = np.concatenate(self._arrivals) if self._arrivals else np.zeros(0, dtype=np.int64)
        self._arrivals = []
        if got.shape[0] < n:
            got = np.concatenate([np.full(n - got.shape[0], -1, dtype=np.int64), got])
        return torch.from_numpy(np.ascontiguousarray(got[got.shape[0] - n :]))

    def _live(self, g: torch.Tensor) -> torch.Tensor:
        """:meth:`_live_np` of a host tensor."""
        return torch.from_numpy(self._live_np(g.numpy()))

    def _live_np(self, g: np.ndarray) -> np.ndarray:
        """Which int64 generations are still stored (their slot holds them)."""
        return (g >= 0) & (self._gen_np[np.maximum(g, 0) % self.storage.capacity] == g)

    def _link_rows(self, gens: torch.Tensor) -> torch.Tensor:
        """The records linking reads of live generations, in order: stored rows, or on a
        device-rows plane the shadow's compact host rows (``[n, link record bytes]``)."""
        if self.shadow is None:
            return self._gather(gens)
        return torch.from_numpy(self.shadow.read(gens, self.storage))

    def _gather(self, gens: torch.Tensor) -> torch.Tensor:
        """The stored records of live generations, in order (``[n, record_bytes]``)."""
        n = gens.numel()
        if self._rows.shape[0] < n:
            self._rows = torch.empty((max(n, 2 * self._rows.shape[0]), self.rb), dtype=torch.uint8)
        rows = self._rows[:n]
        self.storage.gather(gens, rows)
        return rows

    def ingest(self, gens: torch.Tensor) -> torch.Tensor:
        """Link new items (generations ``gens``, in order, already in ``gen``; their sources
        were given by :meth:`arrived`); returns the generations that became starts (with the
        extension, in a reused buffer: read them before the next call)."""
        if _native is not None:
            return self._ingest_native(gens.contiguous())
        cap, seq = self.storage.capacity, self.seq
        leaf = gens % cap
        rows = self._link_rows(gens)
        cols = self._link.unpack(rows)
        done = cols[seq.done].clone()
        end = done | cols[seq.truncated] if seq.truncated else done
        self.end[leaf], self.term[leaf] = end, done
        self.next[leaf] = -1
        sources = self._sources(gens.numel())
        self.src[leaf] = sources.to(torch.int32)
        if seq.stream is None:
            streams = torch.zeros(gens.numel(), dtype=torch.int64)
        else:
            streams = cols[seq.stream].to(torch.int64)
        order = torch.argsort(streams, stable=True)  # by (source, key), arrival order within
        order = order[torch.argsort(sources[order], stable=True)]
        s_sorted, r_sorted, g_sorted = streams[order], sources[order], gens[order]
        prev_sorted = torch.roll(g_sorted, 1)
        first = torch.ones_like(s_sorted, dtype=torch.bool)
        first[1:] = (s_sorted[1:] != s_sorted[:-1]) | (r_sorted[1:] != r_sorted[:-1])
        firsts = first.nonzero().squeeze(1).tolist()
        ends = [*firsts[1:], s_sorted.numel()]
        for at, stop in zip(firsts, ends):  # per stream (a few per batch), not per item
            s = (int(r_sorted[at]), int(s_sorted[at]))
            prev_sorted[at] = self.last.get(s, -1)
            self.last[s] = int(g_sorted[stop - 1])
        prev = torch.empty_like(gens)
        prev[order] = prev_sorted
        # no link across an episode end, nor to an item gone from the store
        ok = self._live(prev)
        ok &= ~self.end[prev.clamp(min=0) % cap]
        prev = torch.where(ok, prev, -1)
        self.prev[leaf] = prev
        linked = prev[ok]
        self.next[linked % cap] = gens[ok]
        return self._starts(gens, end)

    def _ingest_native(self, gens: torch.Tensor) -> torch.Tensor:
        """:meth:`ingest` in one native pass over the items (``seq_link``), and the starts in
        another (``seq_starts``: :meth:`_starts`; a reused buffer, read before the next round)."""
        n, cap = gens.numel(), self.storage.capacity
        rows = self._link_rows(gens)
        sources = self._sources(n).contiguous()
        if 2 * (self._tab_used + n) > self._tab.shape[0]:
            self._set_streams(self.streams(), n)
        self._tab_used += _native.seq_link(
            self.prev.data_ptr(), self.next.data_ptr(), self.gen.data_ptr(),
            self.end.data_ptr(), self.term.data_ptr(), self.src.data_ptr(), cap,
            gens.data_ptr(), n, rows.data_ptr(), rows.shape[1], self._off_done, self._off_trunc,
            self._off_stream, self._kind, sources.data_ptr(), self._tab.data_ptr(),
            self._tab.shape[0],
        )  # fmt: skip
        if not hasattr(_native, "seq_starts"):  # an extension built before it
            return self._starts(gens, self.end.numpy()[gens.numpy() % cap])
        cut = self.seq.n_step > 1  # windows an episode end cuts short: up to L - 1 more each
        out = self._work("starts", n * self.seq.window if cut else n, torch.int64)
        k = _native.seq_starts(
            self.prev.data_ptr(), self.gen.data_ptr(), self.end.data_ptr(), cap, gens.data_ptr(),
            n, self.seq.window, cut, out.data_ptr(),
        )  # fmt: skip
        return out[:k]

    def _work(self, name: str, n: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """``n`` values of a reused buffer for index work read before the next call of the same
        name (:class:`Prefixes`; never handed to a caller outside the sampler)."""
        buf = self._scratch.get(name)
        if buf is None:
            buf = self._scratch[name] = Prefixes(dtype, torch.device("cpu"), 64)
        return buf.first(n)

    def _back(self, g: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(item, ok)``: the item ``steps`` links before each of ``g``; ``ok`` where it exists."""
        cap = self.storage.capacity
        if _native is not None:
            g = g.contiguous()
            cur, ok = self._work("back", g.numel(), torch.int64), self._work("ok", g.numel())
            _native.seq_back(
                self.prev.data_ptr(), self.gen.data_ptr(), cap, g.data_ptr(), g.numel(), steps,
                cur.data_ptr(), ok.data_ptr(),
            )  # fmt: skip
            return cur, ok
        ok = torch.ones_like(g, dtype=torch.bool)
        cur = g
        for _ in range(steps):
            p = self.prev[cur % cap]
            ok &= self._live(p)  # a reused slot holds a newer item's links
            cur = torch.where(ok, p, cur)
        return cur, ok

    def _starts(self, gens: torch.Tensor, end) -> torch.Tensor:
        """Starts whose window the new items complete (``end``: bool, which of ``gens`` end an
        episode; computed in NumPy: a few dozen items a round)."""
        L = self.seq.window
        start, ok = self._back(gens, L - 1)
        found = [start.numpy()[ok.numpy()]]
        end = np.asarray(end, dtype=bool)
        if self.seq.n_step > 1 and end.any():  # windows an episode end cuts short
            cur = torch.from_numpy(gens.numpy()[end])
            for back in range(L - 1):  # the ends themselves, then 1 .. L-2 links back
                item, ok = self._back(cur, back)
                found.append(item.numpy()[ok.numpy()])
        starts = np.concatenate(found) if len(found) > 1 else found[0]
        return torch.from_numpy(starts[self._live_np(starts)])

    def windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gens [k, L], m [k])``: each start's window (repeating its last item past its
        end) and its length (with the extension, in reused buffers: read them before the next
        call)."""
        cap, L = self.storage.capacity, self.seq.window
        if _native is not None:
            starts, k = starts.contiguous(), starts.numel()
            out = self._work("windows", k * L, torch.int64).view(k, L)
            m = self._work("lengths", k, torch.int64)
            _native.seq_windows(
                self.next.data_ptr(), cap, starts.data_ptr(), starts.numel(), L,
                out.data_ptr(), m.data_ptr(),
            )  # fmt: skip
            return out, m
        out = torch.empty((starts.numel(), L), dtype=torch.int64)
        out[:, 0] = starts
        m = torch.ones(starts.numel(), dtype=torch.int64)
        alive = torch.ones(starts.numel(), dtype=torch.bool)
        for j in range(1, L):
            cur = out[:, j - 1]
            nxt = self.next[cur % cap]
            alive &= (nxt >= 0) & ~self.end[cur % cap]
            out[:, j] = torch.where(alive, nxt, cur)
            m += alive
        return out, m

    def compose(self, starts: torch.Tensor, out: torch.Tensor) -> np.ndarray | None:
        """Write the delivered rows of ``starts`` into ``out`` (``[k, wire_bytes]``) but the
        address and mass (the sampler's tag). On a device-rows plane the records are gathered
        where they are stored and the n-step values are returned (``float32 [k, 2]``: return
        and discount, for the sampler's trailer upload) instead of written; else ``None``."""
        k, L, rb, seq = starts.numel(), self.seq.window, self.rb, self.seq
        if k == 0:
            return None if self.shadow is None or seq.n_step == 1 else np.zeros((0, 2), np.float32)
        gens, m = self.windows(starts)
        if self.shadow is not None:
            return self._compose_device(starts, gens, m, out)
        rows = self._gather(gens.reshape(-1)).view(k, L, rb)
        if seq.n_step == 1:
            out[:, : L * rb].copy_(rows.reshape(k, L * rb))
            return
        at = seq.trailer_at(rb) + 16  # after the address and mass
        if _native is not None and out.device.type == "cpu" and out.stride(1) == 1:
            _native.seq_nstep(
                rows.data_ptr(), k, L, rb, m.data_ptr(), gens.data_ptr(), self.term.data_ptr(),
                self.storage.capacity, self._off_reward, float(seq.gamma), out.data_ptr(),
                out.stride(0), at,
            )  # fmt: skip
            return
        last = m - 1
        out[:, :rb].copy_(rows[:, 0])
        out[:, rb : 2 * rb].copy_(rows[torch.arange(k), last])
        rewards = self.spec.unpack(rows.reshape(k * L, rb))[seq.reward].view(k, L)
        steps = torch.arange(L)
        scale = torch.pow(torch.tensor(seq.gamma, dtype=torch.float64), steps)
        inside = steps[None, :] < m[:, None]
        ret = (rewards.double() * scale * inside).sum(dim=1)
        disc = torch.pow(torch.tensor(seq.gamma, dtype=torch.float64), m.double())
        disc = torch.where(self.term[gens[torch.arange(k), last] % self.storage.capacity], 0, disc)
        vals = out[:, at : at + 8].view(torch.float32)
        vals[:, 0] = ret.float()
        vals[:, 1] = disc.float()

    def _compose_device(
        self, starts: torch.Tensor, gens: torch.Tensor, m: torch.Tensor, out: torch.Tensor
    ) -> np.ndarray | None:
        """:meth:`compose` on a device-rows plane: gathers on the rows' device (the storage's
        ``gather`` into ``out``'s columns), n-step values from the host shadow and links."""
        k, L, rb, seq, st = starts.numel(), self.seq.window, self.rb, self.seq, self.storage
        if seq.n_step == 1:  # slices: the window's records back to back
            flat = gens.reshape(-1)
            buf = self._device_rows(out.device, k * L)
            st.gather(flat, buf)
            out[:, : L * rb].copy_(buf.view(k, L * rb))
            return None
        g, mm = gens.numpy(), m.numpy()
        last = g[np.arange(k), mm - 1]
        st.gather(starts, out[:, :rb])  # the start records
        st.gather(torch.from_numpy(last), out[:, rb : 2 * rb])  # the windows' last records
        link = self.shadow.read(g.reshape(-1), st)  # [k * L, link bytes], host
        at = self._link.offsets[seq.reward]
        rewards = np.ascontiguousarray(link[:, at : at + 4]).view(np.float32).reshape(k, L)
        terminal = self.term.numpy()[last % st.capacity]
        return nstep_values(rewards, mm, terminal, float(seq.gamma))

    def _device_rows(self, device: torch.device, n: int) -> torch.Tensor:
        """``n`` reused scratch records on ``device`` (a slice's gather lands there first)."""
        buf = self._scratch.get(f"rows:{device}")
        if buf is None:
            buf = self._scratch[f"rows:{device}"] = Prefixes(torch.uint8, device, 64 * self.rb)
        return buf.first(n * self.rb).view(n, self.rb)

    def _n_step_outputs(self) -> tuple:
        """``(names, dtypes, shapes, sizes, offsets)`` of what :meth:`unpack` returns of an
        n-step row: the first item's fields, the last item's (but reserved ``_`` ones), the
        return and the discount."""
        fields, off, rb = self.spec.fields.items(), self.spec.offsets, self.rb
        at = self.seq.trailer_at(rb) + 16
        rows = [(n, f.dtype, f.shape, f.nbytes, off[n]) for n, f in fields]
        last = [(n, f) for n, f in fields if n[0] != "_"]
        rows += [(f"_last_{n}", f.dtype, f.shape, f.nbytes, rb + off[n]) for n, f in last]
        f32 = torch.float32
        rows += [("_return", f32, (), 4, at), ("_discount", f32, (), 4, at + 4)]
        return tuple(tuple(col) for col in zip(*rows))

    def unpack(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """A learner's delivered rows as fields (a copy; see the module docstring; n-step
        fields from the extension land in a pooled buffer, reused once the caller drops them)."""
        n, L, rb, seq = records.shape[0], self.seq.window, self.rb, self.seq
        if self._outputs is not None and records.is_cpu and records.stride(1) == 1:
            sizes, offsets = self._outputs[3:]
            out = self._fields.take(n)
            _native.unpack_rows(
                records.data_ptr(), records.shape[1], records.stride(0), n,
                tuple(t.data_ptr() for t in out.values()), sizes, offsets, (0,) * len(out),
            )  # fmt: skip
            return out
        if seq.n_step == 1:
            flat = records[:, : L * rb].reshape(n * L, rb)
            fields = self.spec.unpack(flat)
            return {k: v.reshape(n, L, *v.shape[1:]) for k, v in fields.items()}
        first = self.spec.unpack(records[:, :rb].contiguous())
        last = self.spec.unpack(records[:, rb : 2 * rb].contiguous())
        at = seq.trailer_at(rb) + 16
        vals = records[:, at : at + 8].contiguous().view(torch.float32)
        out = {k: v.clone() for k, v in first.items()}
        out.update({f"_last_{k}": v.clone() for k, v in last.items() if k[0] != "_"})
        out["_return"], out["_discount"] = vals[:, 0].clone(), vals[:, 1].clone()
        return out

    def state_dict(self) -> dict[str, object]:
        """Links, episode ends, sources and each stream's newest item."""
        last = self.streams()
        keys = sorted(last)
        return {
            "prev": self.prev.clone(),
            "next": self.next.clone(),
            "end": self.end.clone(),
            "term": self.term.clone(),
            "src": self.src.clone(),
            "streams": torch.tensor(keys, dtype=torch.int64).reshape(-1, 2),
            "stream_last": torch.tensor([last[k] for k in keys], dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` (same capacity)."""
        for name in ("prev", "next", "end", "term", "src"):
            getattr(self, name).copy_(state[name])
        keys = [tuple(k) for k in state["streams"].tolist()]
        self._set_streams(dict(zip(keys, state["stream_last"].tolist())), 0)
        self._arrivals = []
