"""Entry point: ``python -m conduit_dist.bench NAME [options]``."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import sys

from conduit_dist.bench import BENCHES


def main(argv: list[str] | None = None) -> None:
    """Dispatch to ``conduit_dist.bench.NAME.main`` with the remaining arguments.

    An unknown or missing name is an argparse error (exit status 2) listing the benchmarks.
    """
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="python -m conduit_dist.bench",
        usage="%(prog)s [-h] NAME [options]",
        description="Benchmarks; NAME --help lists a benchmark's options.",
    )
    p.add_argument("name", choices=BENCHES, metavar="NAME", help=f"one of {', '.join(BENCHES)}")
    a = p.parse_args(argv[:1])  # the options are the benchmark's own parser's to check
    importlib.import_module(f"conduit_dist.bench.{a.name}").main(argv[1:])


if __name__ == "__main__":
    faulthandler.enable()  # a rank that crashes in native code prints its threads' stacks
    main()
