"""The round's meta row: named int64 columns, one layout for every schedule.

Every rank contributes one row per round; after the round's exchange every rank holds every
rank's row (the ``meta`` matrix, ``[world, width]``), from which it computes the same placement
plan, allocation and weights broadcast as every other rank. The general schedule exchanges it
before ingestion (its ``SIZE`` and sampler columns are unused there) and, when the sampler
reports values of its shard or a payload rides, once more after ingestion in the header
exchange; the fused schedule sends it once, as each peer's header; at world size 1 it is this
rank's own row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STAGED = 0  # items this rank ingests this round (staged, or written ahead into its shard)
REQUEST = 1  # the batch this rank fetches (0: a flush)
VERSION = 2  # the newest weights version this rank published (the source's row is read)
WBYTES = 3  # bytes of those weights
STALE = 4  # items this shard evicted as too old at round start (max_policy_age)
SIZE = 5  # this shard's items once the round's items are in
PAYLOAD = 6  # a learner's reduce payload follows in the header exchange
WSHARD = 7  # a sharded (FSDP2) weights buffer's header bytes (0: not sharded)
BASE = 8  # then: the sampler's values (ReportsMeta), then per-destination counts (Streams)
NAMES = ("staged", "request", "version", "wbytes", "stale", "size", "payload", "wshard")


@dataclass(frozen=True)
class MetaLayout:
    """Where everything sits in a meta row.

    Attributes:
        sampler_width: int64 values the sampler adds (``ReportsMeta.meta_width``; 0: none).
        routes: per-destination staged counts (``world`` when a placement routes streams, so
            every rank learns the whole plan; 0: the plan is computed from ``STAGED``).
    """

    sampler_width: int = 0
    routes: int = 0

    @property
    def width(self) -> int:
        """int64 values in a row."""
        return BASE + self.sampler_width + self.routes

    def sampler(self, meta: np.ndarray) -> np.ndarray:
        """``[world, sampler_width]``: every shard's sampler values."""
        return meta[:, BASE : BASE + self.sampler_width]

    def routed(self, meta: np.ndarray) -> np.ndarray:
        """``int64 [src, dst]``: the items each rank sends each shard (routed rounds)."""
        at = BASE + self.sampler_width
        return meta[:, at : at + self.routes]

    def fill(
        self,
        row: np.ndarray,
        staged: int,
        request: int,
        version: int,
        wbytes: int,
        stale: int,
        size: int,
        payload: bool,
        sampler=(),
        routed: np.ndarray | None = None,
        wshard: int = 0,
    ) -> None:
        """Write one rank's row in place (the columns in :data:`NAMES` order)."""
        row[:BASE] = (staged, request, version, wbytes, stale, size, payload, wshard)
        if self.sampler_width:  # unused in a general round's first exchange: zeros
            row[BASE : BASE + self.sampler_width] = sampler if len(sampler) else 0
        if self.routes:
            row[BASE + self.sampler_width :] = 0 if routed is None else routed
