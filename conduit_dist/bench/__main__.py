"""Entry point: ``python -m conduit_dist.bench NAME [options]``."""

from __future__ import annotations

import importlib
import sys

from conduit_dist.bench import BENCHES


def main(argv: list[str] | None = None) -> None:
    """Dispatch to ``conduit_dist.bench.NAME.main``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        got = argv[0] if argv else "nothing"
        raise SystemExit(f"usage: python -m conduit_dist.bench {{{','.join(BENCHES)}}}; got {got}")
    importlib.import_module(f"conduit_dist.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main()
