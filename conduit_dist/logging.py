"""Rank-aware logging: only rank 0 speaks unless asked otherwise."""

from __future__ import annotations

import logging

from conduit_dist.collectives.dist import get_rank

logger = logging.getLogger("conduit_dist")


def log_rank_zero(msg: str, *args: object, level: int = logging.INFO) -> None:
    """Log ``msg`` on global rank 0 only."""
    if get_rank() == 0:
        logger.log(level, msg, *args)
