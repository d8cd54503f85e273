"""A plane's checkpoints as one part of it: the checkpoint being written in the background, the
in-memory state, restores (``DataPlane.checkpoint`` / ``restore`` / ``state_dict`` /
``load_state_dict`` delegate here)."""

from __future__ import annotations

from collections.abc import Mapping

from conduit_dist.checkpoint import restore as restore_mod
from conduit_dist.checkpoint import save as save_mod
from conduit_dist.checkpoint import state
from conduit_dist.checkpoint.writer import Checkpoint
from conduit_dist.errors import CheckpointError, ConfigError


class Checkpoints:
    """Checkpoints of one plane.

    Args:
        parts: the plane's parts (``plane/build.py``).
        spec: the plane's spec (as the user built it).
    """

    def __init__(self, parts, spec) -> None:
        self.p, self.spec = parts, spec
        self.current: Checkpoint | None = None  # the latest checkpoint (maybe still writing)
        self.restore_dropped = 0  # items a restore could not fit (see restore.py)

    def counters(self) -> dict[str, int]:
        """For ``store_stats``: items the latest restore could not fit."""
        return {"restore_dropped": self.restore_dropped}

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the checkpoint being written, if any (its thread reads the tiers)."""
        if self.current is not None:
            self.current.wait(timeout_s)

    def raise_failure(self) -> None:
        """Raise a finished checkpoint's failure once (at the next call on the plane).

        Raises:
            CheckpointError: the background write failed.
        """
        ck = self.current
        if ck is not None and ck.error is not None and ck.done:
            self.current = None
            ck.wait()

    def close(self) -> CheckpointError | None:
        """Let a checkpoint still writing finish; returns its failure (raised once the plane
        is released)."""
        try:
            self.wait()
        except CheckpointError as e:
            return e
        return None

    def state_dict(self) -> dict[str, object]:
        """This rank's state: its parts' state dicts (``checkpoint/state.py``; tensors, ints and
        dicts: ``torch.load(..., weights_only=True)`` loads it). Not collective: it waits for a
        running round, whose batch stays for its fetch; call it at the same point on every rank.

        Every tensor in it is a copy, the store's items included (a CUDA tier's on its device, a
        disk tier's in host memory): later rounds do not change it. For a store too large to
        copy, :meth:`checkpoint` writes the items from a copy-on-write snapshot instead.

        Raises:
            RuntimeError: if items were put since the last round.
        """
        self.p.control.quiet()
        return state.save(self.p, self.spec)

    def load_state_dict(self, saved: dict[str, object]) -> None:
        """Restore :meth:`state_dict` (collective: the ranks check they agree on the round; a
        round launched before it is dropped, its batch would be stale).

        Raises:
            ConfigError: on another world size or spec, staged items, or ranks at different
                rounds.
        """
        self.wait()  # its thread reads the tiers this overwrites
        state.load(self.p, self.spec, saved)

    def checkpoint(
        self,
        root: str,
        *,
        extra: Mapping[str, object] | None = None,
        write_mbps: float = 0.0,
        checksum_mbps: float = 0.0,
        keep: int = 2,
        timeout_s: float = 600.0,
    ) -> Checkpoint:
        """Checkpoint the whole plane at this round boundary, written in the background
        (collective: call it at the same point on every rank).

        Returns once every rank agreed on the round and fixed its items (a copy-on-write
        snapshot: rounds go on while a thread writes ``root/ckpt-ROUND``). A checkpoint still
        writing is waited for first; a failed write raises at the next call on the plane.

        Args:
            root: directory of checkpoints (one file system all ranks see).
            extra: this rank's own state to keep with it (tensors, numbers, strings, dicts;
                e.g. model and optimizer), returned by :meth:`restore`.
            write_mbps: the items' rate limit in MB/s (0: none: the writer stays ahead of the
                rounds' overwrites, so the rounds copy little).
            checksum_mbps: the rate limit of the checksum pass over the written items (0: none).
            keep: complete checkpoints kept under ``root`` (older ones are removed).
            timeout_s: how long rank 0 waits for the other ranks' parts.

        Returns:
            The checkpoint in flight (``wait()`` for it).

        Raises:
            CheckpointError: ranks at different rounds, items staged since the last round, or
                the previous checkpoint failed.
            ConfigError: on a bad ``keep`` or rate.
        """
        if not (isinstance(keep, int) and keep >= 1):
            raise ConfigError(f"checkpoint keep: expected an int >= 1, got {keep!r}")
        for name, mbps in (("write_mbps", write_mbps), ("checksum_mbps", checksum_mbps)):
            if not (isinstance(mbps, int | float) and mbps >= 0):
                raise ConfigError(f"checkpoint {name}: expected a number >= 0, got {mbps!r}")
        self.wait(timeout_s)
        self.p.control.quiet()
        self.current = save_mod.begin(
            self.p, self.spec, str(root), extra, rates=(write_mbps, checksum_mbps), keep=keep,
            timeout_s=timeout_s,
        )  # fmt: skip
        return self.current

    def restore(self, path: str) -> dict[str, object] | None:
        """Restore a checkpoint: ``path`` itself, or the newest complete one under it (a torn
        or corrupted one is skipped), onto this plane, of the same or another world size and
        tier layout (collective; ``checkpoint/restore.py``).

        Returns:
            The ``extra`` this rank saved (on a larger world: old rank 0's for new ranks).

        Raises:
            CheckpointError: when no complete checkpoint is there.
            ConfigError: on another spec, or items put since the last round.
        """
        self.wait()
        extra, self.restore_dropped = restore_mod.restore(self.p, self.spec, str(path))
        return extra
