"""``torchrun --standalone --nproc_per_node=2 -m conduit_dist.bench strategies``: model choices.

Calibrates the bandwidth model cold (probe) and again from its cache, then over a sweep of message
sizes (1 KiB to 64 MiB per peer) and skews (``uniform``: every rank sends S to every rank; ``hot``:
every rank sends S to rank 0 only; ``empty``: the last rank sends nothing) times every strategy
(median of repeats, slowest rank) and compares with the model: relative prediction error of every
(strategy, point), and (time of the chosen strategy) / (time of the best measured one). JSON last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import numpy as np
import torch.distributed as dist

import conduit_dist as cd
from conduit_dist.bench.common import emit, number
from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.model import build, time_strategies
from conduit_dist.collectives.model.calibration import NET_REST_S
from conduit_dist.collectives.strategies import make_strategies
from conduit_dist.collectives.topology import discover

KIB = 1024


def skews(world: int, size: int) -> dict[str, np.ndarray]:
    """The byte matrices of one sweep point."""
    uniform = np.full((world, world), size, dtype=np.int64)
    hot = np.zeros((world, world), dtype=np.int64)
    hot[:, 0] = size
    empty = uniform.copy()
    empty[-1, :] = 0
    return {"uniform": uniform, "hot": hot, "empty": empty}


def main(argv: list[str]) -> None:
    """Run the sweep (every rank); rank 0 prints the JSON line last."""
    p = argparse.ArgumentParser(prog="python -m conduit_dist.bench strategies")
    p.add_argument(
        "--sizes-kib",
        nargs="+",
        type=number(int, 1),
        default=[1, 4, 16, 64, 256, 1024, 4096, 16384, 65536],
    )
    p.add_argument("--repeats", type=number(int, 1), default=11)
    a = p.parse_args(argv)
    cd.init_distributed()
    ex = Exchange(120.0)
    topo = discover(ex)
    cache = tempfile.mkdtemp(prefix="conduit_bw_") if ex.rank == 0 else ""
    cache = _share_str(cache)
    from conduit_dist.collectives.model import BandwidthModel
    from conduit_dist.plane.build import DECLARED

    declared = BandwidthModel.declared(DECLARED[0], DECLARED[1])
    model, cold = build(ex, topo, True, cache, declared)
    cached_model, warm = build(ex, topo, True, cache, declared)
    assert cached_model.source == "cache", cached_model.source
    links = topo.link_matrix()
    rest = NET_REST_S if (links == 2).any() else 0.0
    strategies = make_strategies()
    rows, errors, ratios = [], [], []
    for kib in a.sizes_kib:
        for skew, matrix in skews(ex.world, kib * KIB).items():
            reps = a.repeats if kib < 4096 else max(3, a.repeats // 3)
            # measured as calibrated: rested calls where a network link is in the layout
            measured = time_strategies(ex, strategies, matrix, reps, rest_s=rest)
            predicted = {n: model.predict(n, matrix, links) for n in strategies}  # knee included
            chosen, _ = model.choose(matrix, links)
            best = min(measured, key=measured.get)
            ratio = measured[chosen] / measured[best]
            errs = {n: abs(predicted[n] - measured[n]) / measured[n] for n in strategies}
            errors += list(errs.values())
            ratios.append(ratio)
            rows.append(
                {
                    "per_peer_kib": kib,
                    "skew": skew,
                    "chosen": chosen,
                    "best": best,
                    "chosen_over_best": ratio,
                    "measured_ms": {n: v * 1e3 for n, v in measured.items()},
                    "predicted_ms": {n: v * 1e3 for n, v in predicted.items()},
                }
            )
            if ex.rank == 0:
                print(
                    f"{kib:>6} KiB {skew:>7}: chosen {chosen:<10} best {best:<10} "
                    f"ratio {ratio:.2f}  "
                    + " ".join(
                        f"{n}={measured[n] * 1e3:.2f}/{predicted[n] * 1e3:.2f}" for n in strategies
                    ),
                    flush=True,
                )
    if ex.rank == 0:
        summary = {
            "median_pred_error": statistics.median(errors),
            "median_chosen_over_best": statistics.median(ratios),
            "max_chosen_over_best": max(ratios),
            "calibration_s_cold": cold,
            "calibration_s_cached": warm,
        }
        emit("strategies", rows, summary, world=ex.world, model=model.to_json())
    ex.close()
    if ex.rank == 0:
        for f in os.listdir(cache):
            os.remove(os.path.join(cache, f))
        os.rmdir(cache)
    cd.destroy_distributed()


def _share_str(text: str) -> str:
    """Rank 0's string on every rank (a fixed-size byte broadcast)."""
    import torch

    buf = torch.zeros(256, dtype=torch.uint8)
    if dist.get_rank() == 0:
        raw = text.encode()[:256]
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return bytes(buf.tolist()).rstrip(b"\0").decode()


if __name__ == "__main__":
    main(__import__("sys").argv[1:])
