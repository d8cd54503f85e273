"""Grouped settings of a :class:`~conduit_dist.plane.DataPlane`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.errors import ConfigError
from conduit_dist.registry import BANDWIDTHS, SHARED_MEMORY, STRATEGIES, check_choice


@dataclass(frozen=True)
class TransportConfig:
    """How a plane's rounds move data between ranks: ``DataPlane(..., transport=...)``.

    Args:
        timeout_s: seconds any collective of the plane may take before it fails with
            ``RoundError`` (naming the ranks that did not reach it).
        strategy: ``auto`` (the bandwidth model picks the cheapest per exchange) or a name from
            ``registry.STRATEGIES`` to force one.
        bandwidth: ``declared`` (datasheet-like numbers, no start-up cost), ``calibrate`` (probe
            the links at start-up, cached in ``bandwidth_cache``) or a ``BandwidthModel``.
        bandwidth_cache: directory of the calibration cache (``None``: no cache).
        shared_memory: move host rows between the plane's ranks through ``/dev/shm`` instead
            of gloo's sockets (``collectives/shm.py``; rows on the GPU still go through the
            group). ``"auto"`` (the default): on where every rank of the plane is on one host
            and ``/dev/shm`` has room for what all of them map at start-up
            (``shm_open.room_for``), else off (logged once, with the reason); ``True``: on, and
            a plane whose ranks do not share ``/dev/shm``, or that lacks that room, is refused;
            ``False``: off.
        weights_bucket_mb: the largest piece, in MiB, of a weights transfer (each learner's
            part goes to each receiver in pieces of this size; docs/weights.md). ``None``:
            ``flow.weights.BUCKET_BYTES``.

    Raises:
        ConfigError: on a value outside the allowed ones, naming the field.
    """

    timeout_s: float = 60.0
    strategy: str = "auto"
    bandwidth: str | BandwidthModel = "declared"
    bandwidth_cache: str | None = "~/.cache/conduit_dist"
    shared_memory: bool | str = "auto"
    weights_bucket_mb: float | None = None

    def __post_init__(self) -> None:
        t = self.timeout_s
        if (
            isinstance(t, bool)
            or not isinstance(t, int | float)
            or not (t > 0 and math.isfinite(t))
        ):
            raise ConfigError(f"transport.timeout_s: expected a finite number > 0, got {t!r}")
        check_choice("transport.strategy", self.strategy, STRATEGIES)
        if not isinstance(self.bandwidth, BandwidthModel):
            check_choice("transport.bandwidth", self.bandwidth, (*BANDWIDTHS, "a BandwidthModel"))
        if not (isinstance(self.shared_memory, bool) or self.shared_memory == "auto"):
            raise ConfigError(
                f"transport.shared_memory: expected one of {list(SHARED_MEMORY)}, got "
                f"{self.shared_memory!r}"
            )
        mb = self.weights_bucket_mb
        if mb is not None and (
            isinstance(mb, bool) or not isinstance(mb, int | float)
            or not (mb > 0 and math.isfinite(mb)) or self.weights_bucket_bytes < 8
        ):  # fmt: skip
            raise ConfigError(
                f"transport.weights_bucket_mb: expected a finite number > 0 (at least 8 bytes) or "
                f"None, got {mb!r}"
            )
        if self.bandwidth_cache is not None and not isinstance(self.bandwidth_cache, str):
            raise ConfigError(
                f"transport.bandwidth_cache: expected a directory path or None, got "
                f"{self.bandwidth_cache!r}"
            )

    @property
    def weights_bucket_bytes(self) -> int:
        """``weights_bucket_mb`` in bytes, rounded down to a multiple of 8 (0: the default)."""
        if self.weights_bucket_mb is None:
            return 0
        return int(self.weights_bucket_mb * (1 << 20)) // 8 * 8

    @classmethod
    def of(cls, value: TransportConfig | None) -> TransportConfig:
        """``value``, or the defaults for ``None``.

        Raises:
            ConfigError: on anything else.
        """
        if value is None:
            return cls()
        if not isinstance(value, cls):
            raise ConfigError(
                f"transport: expected a conduit_dist.TransportConfig or None, got "
                f"{type(value).__name__}"
            )
        return value
