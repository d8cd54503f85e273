"""A DataLoader-style face over the round protocol: ``ExperienceLoader`` on learners,
``ExperienceWriter`` on actors.

The plane's protocol is one round per iteration on every rank (a learner's ``fetch``, an actor's
``flush``). These two classes run it for the user: the loader yields learner batches (on the
plane's device), the writer puts an actor's items and takes part in the round, and both count
the same rounds, so a loop written with them keeps every rank in step.

Colocated (every rank acts and learns)::

    def collect():  # one env step on this rank: the items to put (or None)
        ...
        return transitions

    # model=qnet: the next round hides behind this batch's backward
    loader = cd.ExperienceLoader(
        plane, batch_size=128, collect=collect, min_size=1_000, rounds=10_000, model=qnet
    )
    for batch in loader:
        loss = td_loss(qnet, batch)
        opt.zero_grad()
        loss.backward()  # launches the next round (schedule="overlap")
        opt.step()
    plane.close()

Disaggregated (``learner_ranks=[0]``): the learner iterates a loader without ``collect``; every
actor runs ``cd.ExperienceWriter(plane, model=policy)`` for the same number of rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils.data import IterableDataset, get_worker_info

from conduit_dist.errors import ConfigError
from conduit_dist.integrations.token_loader import check_token_args, iterate_tokens
from conduit_dist.plane import DataPlane
from conduit_dist.registry import check_count
from conduit_dist.tokens import TokenPlane

Batch = Mapping[str, torch.Tensor]


class ExperienceLoader(IterableDataset):
    """Iterate learner batches from a :class:`DataPlane`, one round per iteration.

    Each iteration calls ``collect()`` (if given) and puts what it returns, then, once the
    global store holds ``min_size`` items, yields ``plane.fetch(batch_size)``; before that the
    round only ingests (``flush``) and nothing is yielded. With ``model`` (or a module the
    caller attached), ``schedule="overlap"`` launches the next round at the module's backward,
    so it runs behind this batch's backward and optimizer step, exactly as a hand-written
    ``put``/``fetch`` loop would.

    Iteration ends after ``rounds`` rounds (``None``: no bound; leave with ``break``), or when
    the plane is closed: the next iteration checks it and stops. Every rank must run the same
    number of rounds (actors through :class:`ExperienceWriter` or ``plane.flush()``), so a
    ``break`` must be decided the same way on every rank (e.g. from ``plane.stored``). Iterating
    the loader again continues from the rounds it has run (it counts them in ``rounds_run``).

    Args:
        plane: the data plane (this rank a learner).
        batch_size: items each learner's batch holds.
        collect: called once per round before the fetch; returns this rank's items to put
            (a batch matching the spec) or ``None`` (nothing this round).
        min_size: yield only once the global store (``plane.stored``) holds this many items.
        rounds: rounds to run in all (warm-up rounds included); ``None``: unbounded.
        model: attach this module for the loop's duration (detached when iteration ends).
        wait_s: passed to ``fetch``: run further rounds for up to this long while nothing can
            be delivered. Those rounds count in ``rounds_run`` but are not known in advance, so
            the last fetch may end past ``rounds``: where every rank must run the same number
            of rounds, prefer ``min_size`` (counted exactly).
        max_policy_age: passed to ``fetch`` (``None``: the plane's bound).
        donate: put ``collect``'s tensors with ``donate=True`` (do not reuse them until the
            next round has completed).
        token_budget: with a :class:`~conduit_dist.tokens.TokenPlane`: tokens per
            micro-batch; ``batch_size`` is then the global batch in groups, ``rounds`` the
            number of global batches, ``collect`` returns ``(batch, lengths)``, and the loader
            yields :class:`~conduit_dist.tokens.MicroBatch` es as groups complete
            (``integrations/token_loader.py``).

    Raises:
        ConfigError: on an actor rank, a bad ``batch_size`` / ``min_size`` / ``rounds``, a
            ``collect`` that is not callable, or iteration inside a ``DataLoader`` worker
            process (the plane lives in this process: use ``num_workers=0``).

    Example::

        for batch in cd.ExperienceLoader(plane, batch_size=256, rounds=1_000, wait_s=30):
            loss(batch).backward()
    """

    def __init__(
        self,
        plane: DataPlane,
        batch_size: int,
        *,
        collect: Callable[[], Batch | None] | None = None,
        min_size: int = 0,
        rounds: int | None = None,
        model: nn.Module | None = None,
        wait_s: float = 0.0,
        max_policy_age: int | None = None,
        donate: bool = False,
        token_budget: int | None = None,
    ) -> None:
        super().__init__()
        self.token_budget = token_budget
        if isinstance(plane, TokenPlane):  # micro-batches of whole groups (token_loader.py)
            check_token_args(plane, token_budget, min_size, donate, max_policy_age)
        elif not isinstance(plane, DataPlane):
            raise ConfigError(f"ExperienceLoader plane: expected a DataPlane, got {type(plane)}")
        elif not plane.is_learner:
            raise ConfigError(
                f"ExperienceLoader: rank {plane.rank} is an actor (learners: "
                f"{list(plane.learner_ranks)}); actors use cd.ExperienceWriter or plane.flush()"
            )
        check_count("ExperienceLoader batch_size", batch_size, 1)
        check_count("ExperienceLoader min_size", min_size, 0)
        if rounds is not None:
            check_count("ExperienceLoader rounds", rounds, 1)
        if collect is not None and not callable(collect):
            raise ConfigError(f"ExperienceLoader collect: expected a callable, got {collect!r}")
        self.plane, self.batch_size, self.collect = plane, batch_size, collect
        self.min_size, self.rounds, self.model = min_size, rounds, model
        self.wait_s, self.max_policy_age, self.donate = wait_s, max_policy_age, donate
        self.rounds_run = 0  # rounds this loader ran (warm-up ones included)
        self._seen: int | None = None  # the latest round counted
        self.batches = 0  # batches it yielded
        self.exposed_ms = 0.0  # summed over its fetches: time waited inside fetch
        self.hidden_ms = 0.0  # round time that ran before fetch was called

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Yield batches; see the class docstring."""
        if get_worker_info() is not None:
            raise ConfigError(
                "ExperienceLoader: iterated in a DataLoader worker process; the plane belongs "
                "to the main process: use DataLoader(loader, batch_size=None, num_workers=0) "
                "or iterate the loader directly"
            )
        plane = self.plane
        if isinstance(plane, TokenPlane):
            yield from iterate_tokens(self)
            return
        if self._seen is None:  # rounds finished before the loop are not the loader's
            self._seen = plane.round - 1
        if self.model is not None:
            plane.attach(self.model)
        try:
            while (self.rounds is None or self.rounds_run < self.rounds) and not plane.closed:
                if self.collect is not None:
                    items = self.collect()
                    if items is not None:
                        plane.put(items, donate=self.donate)
                if plane.stored < self.min_size:  # the same on every rank
                    plane.flush()
                    plane.wait()  # plane.stored then counts this round's items
                    self._count(plane.round - 1)
                    continue
                batch = plane.fetch(
                    self.batch_size, wait_s=self.wait_s, max_policy_age=self.max_policy_age
                )
                timing = plane.last_fetch
                self._count(timing.round)
                self.exposed_ms += timing.exposed_ms
                self.hidden_ms += timing.hidden_ms
                self.batches += 1
                yield batch
        finally:
            if self.model is not None and not plane.closed:
                plane.detach()

    def __getstate__(self) -> dict:
        """Refuse to be pickled: a spawned DataLoader worker process would get a copy of the
        plane, which belongs to this process (its group, shard and round worker)."""
        raise ConfigError(
            "ExperienceLoader: cannot be sent to a DataLoader worker process (or pickled); the "
            "plane belongs to the main process: use DataLoader(loader, batch_size=None, "
            "num_workers=0) or iterate the loader directly"
        )

    def _count(self, finished: int) -> None:
        """Count the rounds up to ``finished`` (the latest round a call waited for): the
        fetch's own, those ``wait_s`` or a rate-limited ``put`` ran, a round launched at
        backward."""
        self.rounds_run += finished - self._seen
        self._seen = finished

    def __repr__(self) -> str:
        return (
            f"ExperienceLoader(batch_size={self.batch_size}, min_size={self.min_size}, "
            f"rounds={self.rounds}, rounds_run={self.rounds_run}, batches={self.batches})"
        )


class ExperienceWriter:
    """An actor's side of the round protocol: put, take part in the round, pull new weights.

    On an actor rank each :meth:`write` is one round (``put`` then ``flush``); on a learner
    rank (colocated) it only puts: the learner's next fetch carries the round. With ``model``,
    each write then loads the newest published weights into it (``pull_weights``).

    Args:
        plane: the data plane.
        model: the actor's policy, refreshed after every write (``None``: no weights).
        donate: put with ``donate=True``.

    Raises:
        ConfigError: on a bad ``plane``.

    Example::

        writer = cd.ExperienceWriter(plane, model=policy)
        for _ in range(rounds):  # the learner's loader runs the same number of rounds
            writer.write(step_envs(policy))
        print(writer.version)
    """

    def __init__(
        self, plane: DataPlane, *, model: nn.Module | None = None, donate: bool = False
    ) -> None:
        if not isinstance(plane, DataPlane):
            raise ConfigError(f"ExperienceWriter plane: expected a DataPlane, got {type(plane)}")
        self.plane, self.model, self.donate = plane, model, donate
        self.version = 0  # policy version of the weights in model (0: none yet)
        self.rounds_run = 0

    def write(self, items: Batch | None) -> int:
        """Put ``items`` (``None``: nothing this round) and, on an actor, run this round.

        Returns:
            The policy version the next items will carry (the newest weights pulled).

        Raises:
            SpecError: on items that do not match the spec (nothing is staged).
            RoundError: if the round failed on some rank.
        """
        plane = self.plane
        before = plane.round
        if items is not None:
            plane.put(items, donate=self.donate)  # a rate-limited put may run rounds too
        if not plane.is_learner:
            plane.flush()
        self.rounds_run += plane.round - before
        if not plane.is_learner and self.model is not None:
            self.version = plane.pull_weights(self.model) or self.version
        return self.version

    def run(self, collect: Callable[[], Batch | None], rounds: int) -> int:
        """``rounds`` writes of ``collect()``'s items (an actor's whole loop); stops early if the
        plane is closed. Returns the last policy version.

        Raises:
            ConfigError: on a bad ``rounds``, or on a learner rank (its fetches run its
                rounds: a learner's ``write`` only puts).
        """
        check_count("ExperienceWriter.run rounds", rounds, 1)
        if self.plane.is_learner:
            raise ConfigError(
                f"ExperienceWriter.run: rank {self.plane.rank} is a learner; its fetches run "
                "the rounds (use write() beside the loader, or collect= on ExperienceLoader)"
            )
        for _ in range(rounds):
            if self.plane.closed:
                break
            self.write(collect())
        return self.version

    def __repr__(self) -> str:
        return f"ExperienceWriter(rounds_run={self.rounds_run}, version={self.version})"
