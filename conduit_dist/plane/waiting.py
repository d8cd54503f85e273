"""Waiting inside the round protocol: a fetch that nothing can serve yet, or that the rate
limiter holds, and a put the rate limiter holds, run further rounds (so the other side can make
progress) until they may pass or their time is up."""

from __future__ import annotations

import time

import torch

from conduit_dist.errors import EmptyStoreError, RateLimitError


def fetch_records(
    control, batch_size: int, more: bool, reduce, wait_s: float, limiter, oversample: bool = False
) -> torch.Tensor:
    """The records of a fetch (``OverlapController.fetch``), running further rounds while it is
    rate limited (up to ``limiter.timeout_s``) or nothing can be delivered (up to ``wait_s``).

    Raises:
        RateLimitError: held longer than the limiter's ``timeout_s`` (time blocked is counted).
        EmptyStoreError: still nothing to deliver (or, unless ``oversample``, fewer items than
            ``batch_size``) after ``wait_s``.
    """
    t0, blocked = time.monotonic(), 0.0
    try:
        while True:
            try:
                return control.fetch(batch_size, more, reduce, oversample)
            except RateLimitError as e:  # rounds go on, so the actors can insert
                blocked = time.monotonic() - t0
                if blocked >= limiter.timeout_s:
                    raise RateLimitError(f"{e}; waited {blocked:.1f} s") from None
            except EmptyStoreError as e:
                if time.monotonic() - t0 >= wait_s:
                    if wait_s:
                        raise EmptyStoreError(f"{e} (waited {wait_s:g} s)") from None
                    raise
    finally:
        if blocked:  # up to the end of the last held round
            limiter.blocked_s["sample"] += blocked


def wait_to_insert(control, stager, limiter, n: int, rank: int, stored) -> None:
    """Run ``flush`` rounds until ``limiter`` lets ``n`` more items (and this rank's staged ones)
    in; ``stored()`` gives the global store's size for the error.

    Raises:
        ConfigError: on a put no state of the band could let through.
        RateLimitError: after the limiter's ``timeout_s`` (time blocked is counted).
    """
    limiter.check_size("insert", n)
    if limiter.can_insert(n + stager.pending):
        return
    t0 = time.monotonic()
    try:
        while not limiter.can_insert(n + stager.pending):
            if time.monotonic() - t0 > limiter.timeout_s:
                raise RateLimitError(
                    f"put on rank {rank}: waited {limiter.timeout_s:g} s, held by "
                    + limiter.holds("insert", n, stored())
                )
            control.flush()
            control.wait()
    finally:
        limiter.blocked_s["insert"] += time.monotonic() - t0
