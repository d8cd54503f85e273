"""``python -m conduit_dist COMMAND``: the package's command line.

Commands:
    info: the discovered topology, the bandwidth model in use, tier bandwidths and the strategy
        the model picks for a few message sizes. Under torchrun every rank takes part and rank 0
        prints: ``torchrun --standalone --nproc_per_node=2 -m conduit_dist info``.

Without a command it prints the help and exits with status 2; an unknown command is an argparse
error (status 2) listing the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 8 or value % 8:
        raise argparse.ArgumentTypeError(f"expected a multiple of 8 >= 8, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected > 0, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line's parser (one subparser per command)."""
    p = argparse.ArgumentParser(
        prog="python -m conduit_dist",
        description="conduit_dist: a distributed experience data plane for RL.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser(
        "info",
        help="topology, bandwidth model, tier bandwidths, strategy choices",
        description="Print what a DataPlane would discover and choose on this job. Under "
        "torchrun every rank takes part; rank 0 prints.",
    )
    info.add_argument(
        "--calibrate",
        action="store_true",
        help="build the model as bandwidth='calibrate' does: probe the links unless every "
        "rank has a valid cache (world size > 1)",
    )
    info.add_argument(
        "--bandwidth-cache",
        default="~/.cache/conduit_dist",
        help="directory of calibration caches (DataPlane's default); 'none': no cache",
    )
    info.add_argument("--disk-dir", default=None, help="directory of the disk tier measured")
    info.add_argument(
        "--record-bytes", type=_positive_int, default=1024, help="record size of the tiers"
    )
    info.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    info.add_argument("--timeout-s", type=_positive_float, default=60.0)
    info.add_argument("--json", action="store_true", help="also print the report as JSON, last")
    return p


def info(a: argparse.Namespace) -> int:
    """Run ``info`` on this rank (collective under torchrun); rank 0 prints."""
    import conduit_dist as cd
    from conduit_dist.tools.info import collect, format_report

    under_torchrun = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    if under_torchrun:
        cd.init_distributed(a.device, timeout_s=a.timeout_s)
    try:
        cache = None if a.bandwidth_cache.lower() == "none" else a.bandwidth_cache
        report = collect(
            calibrate=a.calibrate,
            bandwidth_cache=cache,
            disk_dir=a.disk_dir,
            record_bytes=a.record_bytes,
            timeout_s=a.timeout_s,
            device=a.device,
        )
        if cd.get_rank() == 0:
            print(format_report(report), flush=True)
            if a.json:
                print(json.dumps(report), flush=True)
    finally:
        if under_torchrun:
            cd.destroy_distributed()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit status.

    Raises:
        SystemExit: on a usage error (status 2), or without a command (the help, status 2).
    """
    p = parser()
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.command is None:
        p.print_help(sys.stderr)
        p.exit(2, "\nerror: a command is required (e.g. info)\n")
    return info(a)


if __name__ == "__main__":
    sys.exit(main())
