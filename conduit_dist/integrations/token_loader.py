"""``ExperienceLoader`` over a :class:`~conduit_dist.tokens.TokenPlane`: learners iterate
micro-batches of whole prompt groups, streamed as groups complete, the same count on every
learner.

``batch_size`` is the global batch in groups, ``token_budget`` the tokens per micro-batch,
``rounds`` the number of global batches; ``collect()`` (colocated generation) runs before each
round and returns ``(batch, lengths)`` to put, or ``None``. Between global batches the loader
publishes ``model``'s version when given (``publish_weights``), so pacing by version advances.
"""

from __future__ import annotations

from collections.abc import Iterator

from conduit_dist.errors import ConfigError
from conduit_dist.tokens import MicroBatch, TokenPlane


def check_token_args(
    plane: TokenPlane,
    token_budget: int | None,
    min_size: int,
    donate: bool,
    max_policy_age: int | None = None,
) -> None:
    """The loader arguments that mean something for a token plane.

    Raises:
        ConfigError: a missing ``token_budget``, or ``min_size`` / ``donate`` /
            ``max_policy_age`` given (a token plane delivers once groups complete, its puts
            copy, and its age bound is the plane's own ``max_policy_age``).
    """
    if plane.rank not in plane.learners:
        raise ConfigError(
            f"ExperienceLoader: rank {plane.rank} is not a learner of the token "
            f"plane (learner_ranks={list(plane.learners)}); producers call "
            "flush() or reserve()"
        )
    if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget < 1:
        raise ConfigError(
            f"ExperienceLoader token_budget: expected an int >= 1 with a "
            f"TokenPlane, got {token_budget!r}"
        )
    if max_policy_age is not None:
        raise ConfigError(
            "ExperienceLoader max_policy_age: a TokenPlane bounds ages with its own "
            f"max_policy_age (and pacing); expected None, got {max_policy_age!r}"
        )
    if min_size or donate:
        raise ConfigError(
            "ExperienceLoader: min_size and donate have no meaning for a "
            "TokenPlane (groups are delivered when complete; puts copy); "
            f"got min_size={min_size}, donate={donate}"
        )


def iterate_tokens(loader) -> Iterator[MicroBatch]:
    """The token loader's loop (see the module docstring)."""
    plane: TokenPlane = loader.plane

    def produce() -> None:
        if loader.collect is not None:
            items = loader.collect()
            if items is not None:
                plane.put(*items)

    while (loader.rounds is None or loader.rounds_run < loader.rounds) and not plane.closed:
        if plane.closed_by >= 0:  # a peer closed the plane: stop cleanly
            return
        for mb in plane.stream(
            loader.batch_size, loader.token_budget, produce=produce, wait_s=loader.wait_s or 600.0
        ):
            loader.batches += 1
            yield mb
        loader.rounds_run += 1  # one global batch
        if loader.model is not None:
            plane.publish_weights(loader.model)
