"""A shard's items as of one round boundary, read while rounds keep writing (copy-on-write).

At :meth:`ShardSnapshot.take` (between rounds) the live items' places are fixed: item ``i``
(oldest first) is at ``(tier[i], slot[i])``. The writer thread then reads them in that order,
``chunk`` items at a time. Rounds keep running: before any slot is overwritten (every write goes
through ``Tier.region``), the tier's ``guard`` copies the ``block`` of slots around it, if a
live item there has not been read yet. A block is released once every item in it was read, so
the copies held are at most the blocks that rounds overwrite ahead of the writer; as the writer
reads oldest first, which is also the order a ring overwrites, that is usually none.

On a CUDA tier three streams meet, and events order them (``tiers/cuda.py``; on host tiers
every event is ``None`` and each copy is done when it returns):

- the stream that took the snapshot: an event recorded at :meth:`ShardSnapshot.__init__` ends
  every write the snapshot must hold (the caller's stream is after the rounds that wrote them);
- the stream that writes the tier (a round's side stream, the demoter's): the guard's clone
  runs there, before the write that follows it on that stream, and records an event;
- the writer thread's own stream, which waits for the snapshot's event before reading the live
  tiers and for a clone's event before reading the clone. Its copies into host memory are
  synchronous (they wait for that stream only), so a chunk is in ``out`` before it is written
  out and checksummed.
"""

from __future__ import annotations

import itertools
import threading

import torch

from conduit_dist.tiers.cuda import cuda_device, on, record, stream_for

BLOCK = 1024  # slots per copy-on-write block


class ShardSnapshot:
    """The live items of ``shard`` at this moment, readable in order from another thread.

    Args:
        shard: a ``Shard`` or ``TieredShard``, quiet (no round or demotion running).
        block: slots per copy-on-write block.
    """

    def __init__(self, shard, block: int = BLOCK) -> None:
        shard.settle()
        self.tiers = shard.tiers
        self.block = block
        self.oldest, self.count = int(shard.oldest), int(shard.size)
        gens = torch.arange(self.oldest, self.oldest + self.count, dtype=torch.int64)
        self.tier, self.slot = shard.locate(gens)
        self.read_upto = 0  # items read so far (oldest first)
        # (tier, block) -> its slots before a write, and the event ending that copy (CUDA)
        self.copies: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self.copied_bytes = 0  # bytes copied ahead of a write, over the snapshot's life
        self._lock = threading.Lock()
        # release[t][b]: items to read before block b of tier t is free (0: holds none of them)
        self._release = []
        order = torch.arange(1, self.count + 1, dtype=torch.int64)
        for k, tier in enumerate(self.tiers):
            n_blocks = (tier.slots + block - 1) // block
            rel = torch.zeros(n_blocks, dtype=torch.int64)
            mine = self.tier == k
            if mine.any():
                rel.scatter_reduce_(0, self.slot[mine] // block, order[mine], "amax")
            self._release.append(rel.tolist())
        # CUDA only (None for host tiers): what the live tiers held here, and the writer's stream
        self.device = cuda_device(t.data.device for t in self.tiers)
        self.taken = record(self.device)
        self.stream = stream_for(self.device)
        for k, tier in enumerate(self.tiers):
            tier.guard = self._guard_for(k)

    def _guard_for(self, k: int):
        def guard(start: int, end: int) -> None:
            if end <= start:
                return
            with self._lock:
                rel, tier = self._release[k], self.tiers[k]
                for b in range(start // self.block, (end - 1) // self.block + 1):
                    if rel[b] > self.read_upto and (k, b) not in self.copies:
                        lo = b * self.block
                        rows = tier.data[lo : min(lo + self.block, tier.slots)].clone()
                        # on the writing thread's current stream, ahead of its write
                        self.copies[(k, b)] = (rows, record(self.device if rows.is_cuda else None))
                        self.copied_bytes += rows.numel()

        return guard

    def read(self, n: int, out: torch.Tensor) -> torch.Tensor:
        """The next ``n`` items' records into ``out`` (``uint8 [>= n, record_bytes]``, host
        memory), oldest first; returns the rows filled. Blocks holding none of the items still
        to read are released.

        The rows are copied from the live tiers without the lock (rounds are not held up), as
        slices of runs of consecutive slots; a block the rounds copied meanwhile (they were
        about to overwrite it) is then read again from its copy, which holds what it held
        before any write.
        """
        a, b = self.read_upto, min(self.read_upto + n, self.count)
        out = out[: b - a]
        segments = list(self._segments(a, b))
        with on(self.stream):  # CUDA: the writer's stream; host copies (below) wait for it
            self._after(self.taken)
            for k, blk, lo, hi, at in segments:
                if (k, blk) not in self.copies:  # a hint: checked again under the lock below
                    out[at : at + hi - lo].copy_(self.tiers[k].data[lo:hi])
            with self._lock:
                for k, blk, lo, hi, at in segments:
                    saved = self.copies.get((k, blk))
                    if saved is not None:  # copied before a write: what the snapshot held
                        rows, made = saved
                        self._after(made)
                        base = blk * self.block
                        out[at : at + hi - lo].copy_(rows[lo - base : hi - base])
                self.read_upto = b
                for key in [key for key in self.copies if self._release[key[0]][key[1]] <= b]:
                    del self.copies[key]
        return out

    def _after(self, event: torch.cuda.Event | None) -> None:
        """CUDA only: the writer's stream waits for ``event`` (its copies come after)."""
        if event is not None:
            self.stream.wait_event(event)

    def _segments(self, a: int, b: int):
        """``(tier, block, first slot, end slot, first row)`` of items ``[a, b)``: runs of
        consecutive slots in one tier, cut at block boundaries."""
        tier, slot = self.tier[a:b], self.slot[a:b]
        cut = torch.ones(b - a, dtype=torch.bool)
        if b - a > 1:
            cut[1:] = (tier[1:] != tier[:-1]) | (slot[1:] != slot[:-1] + 1)
        starts = [*cut.nonzero().squeeze(1).tolist(), b - a]
        for r0, r1 in itertools.pairwise(starts):
            k, lo = int(tier[r0]), int(slot[r0])
            hi = lo + r1 - r0
            at = r0
            while lo < hi:
                blk = lo // self.block
                end = min(hi, (blk + 1) * self.block)
                yield k, blk, lo, end, at
                at += end - lo
                lo = end

    def close(self) -> None:
        """Stop guarding the tiers and drop every copy (when read, or abandoned)."""
        with self._lock:
            for tier in self.tiers:
                tier.guard = None
            self.copies.clear()
