"""Hydra under torchrun: one output directory for all ranks, written by rank 0 only.

Every rank runs ``@hydra.main``. Hydra's default run directory is time-stamped, so ranks that start
a second apart would disagree (hydra#2070), and every rank would write ``.hydra/`` and a log file.
:func:`prepare_hydra_argv` runs before Hydra parses the command line and adds overrides so that:

- all ranks use ``outputs/run-<TORCHELASTIC_RUN_ID>`` (the same on every rank of a torchrun job)
  unless the user set ``hydra.run.dir`` themselves;
- ranks other than 0 write no ``.hydra/`` directory and log to stdout only.
"""

from __future__ import annotations

import os


def prepare_hydra_argv(argv: list[str]) -> list[str]:
    """Return ``argv`` with the per-rank Hydra overrides appended (see module docstring).

    Args:
        argv: ``sys.argv``.

    Returns:
        The new argument list.
    """
    extra: list[str] = []
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    user_dir = any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for a in argv[1:])
    if run_id and run_id != "none" and not user_dir:
        extra.append(f"hydra.run.dir=outputs/run-{run_id}")
    if os.environ.get("RANK", "0") != "0":
        extra += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    return [*argv, *extra]
