"""How a job gets its bandwidth model: the declared numbers, the cached calibration, or a probe.

:func:`calibrate` times every strategy on a few byte patterns (:func:`probe_matrices`) at sizes
from 1 KB to 8 MB per peer (64 KB among them: a round's gradient payload) and fits each
strategy's coefficients, with a network knee where the links show one
(:func:`~conduit_dist.collectives.model.costs.fit_burst`); :func:`agree`
puts rank 0's model on every rank; :func:`build` picks the declared model, the cached one
(``cache.py``) or a fresh calibration, the same on every rank.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.model.cache import cache_path, load_cache, save_cache
from conduit_dist.collectives.model.costs import FEATURES, BandwidthModel, features, fit_burst
from conduit_dist.collectives.strategies import NAMES, Strategy, make_strategies, usable
from conduit_dist.collectives.topology import Topology

log = logging.getLogger("conduit_dist")

PROBE_SIZES = (1024, 16 * 1024, 64 * 1024, 256 * 1024, 2 * 1024 * 1024, 8 * 1024 * 1024)
PROBE_REPEATS = 7
# on a layout with network links every probe call starts after the links rested this long, as a
# round's exchange does after a step's compute: a token-bucket link's burst refills (256 KiB at
# 420 Mbit/s and up) and the probe prices a message as a round meets the link
NET_REST_S = 0.005


def probe_matrices(world: int, per_peer: int) -> dict[str, np.ndarray]:
    """Byte patterns of the probe: uniform, uniform without self chunks (so local-copy and link
    bytes can be told apart), and one hot destination."""
    uniform = np.full((world, world), per_peer, dtype=np.int64)
    cross = uniform.copy()
    np.fill_diagonal(cross, 0)
    hot = np.zeros((world, world), dtype=np.int64)
    hot[:, 0] = per_peer
    return {"uniform": uniform, "cross": cross, "hot": hot}


def time_strategies(
    ex: Exchange,
    strategies: dict[str, Strategy],
    matrix: np.ndarray,
    repeats: int,
    device: torch.device | None = None,
    rest_s: float = 0.0,
) -> dict[str, float]:
    """Median seconds of every strategy moving ``matrix`` bytes (the slowest rank's).

    The strategies take turns within each repeat, as exchanges alternate with other collectives
    in a round (back-to-back calls of one strategy run warmer than it ever does in a round), and a
    noisy moment hits all of them alike. The first repeat is a warm-up. ``device``: the rows'
    device (``None``: the host); on a GPU each call is timed to its completion on the device
    (a start-up probe: synchronising there is what it measures). ``rest_s``: seconds every
    rank sleeps before each call (the links idle, as between a job's rounds).
    """
    me = ex.rank
    rows_out, rows_in = matrix[me].tolist(), matrix[:, me].tolist()
    where = device if device is not None else torch.device("cpu")
    inp = torch.randint(0, 255, (int(sum(rows_out)), 1), dtype=torch.uint8, device=where)
    out = torch.empty((int(sum(rows_in)), 1), dtype=torch.uint8, device=where)
    cuda = where.type == "cuda"
    names = list(strategies)
    samples = torch.zeros(repeats + 1, len(names), dtype=torch.float64)
    for rep in range(repeats + 1):
        for j, name in enumerate(names):
            if rest_s:
                time.sleep(rest_s)
            ex.barrier("probe")
            t0 = time.perf_counter()
            strategies[name].run(ex, out, inp, rows_in, rows_out, -1, "probe", matrix)
            if cuda:  # CUDA only: the collective's own time, not its enqueue
                torch.cuda.synchronize(where)
            samples[rep, j] = time.perf_counter() - t0
    if ex.world > 1:
        ex.run(
            lambda: dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=ex.group, async_op=True),
            "all_reduce(probe times)",
        )
    med = samples[1:].median(dim=0).values
    return {n: float(med[j]) for j, n in enumerate(names)}


def calibrate(
    ex: Exchange,
    topo: Topology,
    sizes=PROBE_SIZES,
    repeats=PROBE_REPEATS,
    device: torch.device | None = None,
) -> BandwidthModel:
    """Time every strategy at a few sizes and patterns, fit each (a collective: every rank).

    Runs as the phase ``start-up: calibrate`` (``start-up: calibrate device rows`` with a
    ``device``): every collective waits with the exchange's timeout.

    Args:
        ex: the plane's exchange.
        topo: the job's topology.
        sizes: bytes per peer of the probes.
        repeats: timed repeats of each (after one warm-up).
        device: probe rows on this device (a plane whose rows live on the GPU: NCCL on device
            tensors); ``None``: host rows. Strategies the group cannot run for those rows
            (``strategies.usable``) are priced at infinity, so they are never chosen.

    Where ranks are on several hosts, every call starts after :data:`NET_REST_S` of rest and a
    knee is fitted where the network shows one (a shaped link's burst).

    Raises:
        PhaseError: if a rank does not take part within the timeout (naming the ranks that never
            entered the phase, where the rendezvous store can tell).
    """
    allowed = NAMES
    if device is not None:
        allowed = usable(device.type == "cuda", ex.cuda_backend)
    strategies = {n: s for n, s in make_strategies().items() if n in allowed}
    links = topo.link_matrix()
    rest = NET_REST_S if (links == 2).any() else 0.0
    samples: dict[str, list[tuple[np.ndarray, float]]] = {n: [] for n in strategies}
    phase = "start-up: calibrate" + (" device rows" if device is not None else "")
    with ex.phase(phase):
        for size in sizes:
            for matrix in probe_matrices(ex.world, size).values():
                timed = time_strategies(ex, strategies, matrix, repeats, device, rest)
                for name, t in timed.items():
                    samples[name].append((features(name, matrix, links), t))
    fitted, burst, over = fit_burst(samples)
    coef = {n: fitted.get(n, np.full(len(FEATURES), np.inf)) for n in NAMES}
    return BandwidthModel(coef, "calibrated", burst, over)


def agree(ex: Exchange, model: BandwidthModel | None) -> BandwidthModel | None:
    """Rank 0's model on every rank (``None`` everywhere if any rank has none).

    Runs as the phase ``start-up: agree on the bandwidth model`` (with the exchange's timeout).
    """
    if ex.world == 1:
        return model
    ok = torch.tensor([1 if model is not None else 0])
    with ex.phase("start-up: agree on the bandwidth model"):
        ex.run(
            lambda: dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ex.group, async_op=True),
            "all_reduce(every rank has a model)",
        )
        if not int(ok):
            return None
        # every strategy's coefficients, then its knee: burst bytes and over_s (-1: none)
        knee = [
            v for n in NAMES for v in (model.burst_bytes.get(n, -1.0), model.over_s.get(n, -1.0))
        ]
        flat = torch.tensor(
            np.concatenate([*(model.coef[n] for n in NAMES), knee]), dtype=torch.float64
        )
        ex.run(
            lambda: dist.broadcast(flat, src=0, group=ex.group, async_op=True),
            "broadcast(coefficients)",
        )
    values = flat.numpy()
    n_coef = len(NAMES) * len(FEATURES)
    parts = values[:n_coef].reshape(len(NAMES), len(FEATURES))
    coef = {n: parts[i].copy() for i, n in enumerate(NAMES)}
    knees = values[n_coef:].reshape(len(NAMES), 2)
    burst = {n: float(knees[i, 0]) for i, n in enumerate(NAMES) if knees[i, 1] >= 0}
    over_s = {n: float(knees[i, 1]) for i, n in enumerate(NAMES) if knees[i, 1] >= 0}
    return BandwidthModel(coef, model.source, burst, over_s)


def build(
    ex: Exchange,
    topo: Topology,
    calibrate_now: bool,
    cache_dir: str | None,
    declared: BandwidthModel,
    device: torch.device | None = None,
) -> tuple[BandwidthModel, float]:
    """The model every rank uses, and the seconds it took (cache, probe, or declared numbers).

    Every collective waits with the exchange's timeout (phases ``start-up: agree on the bandwidth
    model``, ``start-up: calibrate``, ``start-up: calibration cache``). Rank 0 logs the model's
    :meth:`~BandwidthModel.describe` line. ``device``: the model of rows on that device (a GPU
    plane's bulk rows: probed there, cached apart); ``None``: host rows.

    Raises:
        PhaseError: if a rank does not take part in a phase within the timeout.
    """
    start = time.perf_counter()
    if not calibrate_now or ex.world == 1:
        model, seconds = declared, 0.0
    else:
        model = _agreed_model(ex, topo, cache_dir, device)
        seconds = time.perf_counter() - start
    if ex.rank == 0:
        rows = f" (rows on {device})" if device is not None else ""
        log.info("%s%s (%.2fs)", model.describe(), rows, seconds)
    return model, seconds


def _agreed_model(
    ex: Exchange, topo: Topology, cache_dir: str | None, device: torch.device | None = None
) -> BandwidthModel:
    """The cached model if every rank has it, else a fresh calibration (cached per host)."""
    backend = str(dist.get_backend(ex.group))
    backend += f"+{device.type}-rows" if device is not None else ("+shm" if ex.shm else "")
    path = cache_path(cache_dir, backend, topo) if cache_dir else None
    model = agree(ex, load_cache(path, backend, topo) if path else None)
    if model is None:
        model = agree(ex, calibrate(ex, topo, device=device))
        first_on_host = topo.host_of.index(topo.host_of[ex.rank]) == ex.rank
        if path and first_on_host:  # one writer per host
            save_cache(path, model, backend, topo)
        with ex.phase("start-up: calibration cache"):
            ex.barrier("cache written")  # the cache is complete before any rank looks again
    return model
