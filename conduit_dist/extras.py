"""The optional dependencies and the extra of ``pyproject.toml`` that installs each.

``pip install -e .`` installs what the data plane needs: torch and numpy. ``import conduit_dist``,
``cd.DataPlane`` and ``cd.ExperienceLoader`` need nothing more. The jobs around the plane need
extras:

- ``[train]``: hydra-core, omegaconf, wandb, gymnasium, tqdm (``train.py``, ``conduit_dist.train``,
  ``conduit_dist.rl``, ``examples/``);
- ``[report]``: matplotlib (``python -m conduit_dist.report``);
- ``[torchrl]``: torchrl, tensordict (``conduit_dist.integrations.torchrl``,
  ``examples/torchrl_dqn.py`` with ``[train]``);
- ``[rllib]``: ray[rllib] (``conduit_dist.integrations.rllib``, ``examples/rllib_dqn.py``);
- ``[bench]``: all of the above and scipy (``python -m conduit_dist.bench``);
- ``[dev]``: all of the above and the test and lint tools (``scripts/run_tests.sh``).

Code that needs an extra imports it inside :func:`require`, so a missing package names the
extra to install::

    with require("train", "train.py"):
        import hydra
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

PACKAGES = {"hydra": "hydra-core"}
"""The pip name of each optional module whose distribution is named otherwise."""


@contextmanager
def require(extra: str, what: str) -> Iterator[None]:
    """Turn a module missing from the block's imports into a message naming ``extra``.

    Nested blocks (``train.py`` importing ``conduit_dist.rl.env``) give the outermost message:
    the name the user typed.

    Args:
        extra: the extra of ``pyproject.toml`` that installs the block's imports, e.g. ``"train"``.
        what: what needs them, as the message names it, e.g. ``"train.py"``.

    Yields:
        Nothing; the block runs unchanged when its imports are installed.

    Raises:
        ModuleNotFoundError: when a module the block imports (or one of its own dependencies) is
            missing, e.g. ``train.py needs hydra-core (the [train] extra): pip install -e
            ".[train]" in the conduit_dist checkout``; ``name`` is the missing module's. A missing
            ``conduit_dist`` module propagates unchanged.
    """
    try:
        yield
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if top in ("", "conduit_dist"):
            raise
        package = PACKAGES.get(top, top)
        raise ModuleNotFoundError(
            f'{what} needs {package} (the [{extra}] extra): pip install -e ".[{extra}]" in the '
            "conduit_dist checkout",
            name=e.name,
        ) from e
