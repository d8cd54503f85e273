"""The bandwidth model: predict each strategy's time for a round's byte matrix, and choose.

For a byte matrix ``M[src, dst]`` and the link class of every pair (``self``, ``host``, ``net``)
a strategy's time is modelled as

    T = alpha * calls + mu * msgs + sum_c  B_c / beta_c + D_c * gamma_c

- ``calls``: the collective calls the critical rank launches and waits for: 1 for the fused
  all-to-all; one ``isend`` or ``irecv`` per non-empty peer it sends to or receives from (max over
  ranks; gloo does not coalesce ``batch_isend_irecv``) for point-to-point, times the pieces for
  chunked point-to-point; one ``gather`` per destination that receives anything for gather.
- ``msgs``: the messages on the wire at the critical rank: the fused all-to-all sends to and
  receives from every peer, empty pairs included (gloo's ``alltoallv`` posts all ``2 (world-1)``);
  point-to-point only the non-empty ones (as many as its calls); a gather's root receives from
  every other rank and every other rank sends to it. (On NCCL torch's all-to-all skips empty
  pairs, so declared numbers over-price it on sparse matrices there: calibrate.)
- ``B_c``, ``D_c``: bytes over links of class ``c`` on the critical rank, one direction
  (``max_r max(out(r), in(r))``) and both directions at once (``max_r min(out(r), in(r))``). A
  full-duplex link fits ``D_c``'s coefficient to 0; a link whose two directions share a resource
  (loopback TCP, where the CPU copies both ways; measured here: 1.7x) fits it to about ``1/beta``.
  ``self`` is the rank's own chunk (a local copy).
  Gather pads every chunk to a destination's largest and the root takes them one after another,
  so its bytes count ``world * max_s M[s, d]`` per destination ``d``.

The coefficients (seconds per call, per message, per byte) are fitted per strategy by least
squares on relative error from a short probe (:func:`calibrate`), or declared
(:meth:`BandwidthModel.declared`): then every strategy has the same numbers and only its features
(its structure) tell it apart.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from conduit_dist.collectives.exchange import Exchange
from conduit_dist.collectives.strategies import NAMES, Strategy, make_strategies
from conduit_dist.collectives.topology import LINKS, Topology
from conduit_dist.errors import ConfigError

log = logging.getLogger("conduit_dist")

# "msgs" is last so the byte columns keep their indices
FEATURES = ("calls", "bytes_self", "bytes_host", "both_host", "bytes_net", "both_net", "msgs")
_COL = {"self": 1, "host": 2, "net": 4}  # column of B_c; D_c (both directions) follows it
_MSGS = FEATURES.index("msgs")
CACHE_VERSION = 3
TIE_MARGIN = 0.15
SOURCES = ("declared", "calibrated", "cache", "given")


def features(strategy: str, matrix: np.ndarray, links: np.ndarray) -> np.ndarray:
    """The model's features (:data:`FEATURES`) of a strategy on a byte matrix.

    Args:
        strategy: a strategy name.
        matrix: ``[world, world]`` bytes from each source to each destination.
        links: ``[world, world]`` link class index (into ``LINKS``) of each pair.
    """
    world = matrix.shape[0]
    x = np.zeros(len(FEATURES))
    if strategy == "gather":
        dests = np.nonzero(matrix.sum(axis=0))[0]
        x[0] = len(dests)
        is_dest = np.isin(np.arange(world), dests)
        # each rank receives world-1 chunks as a root, and sends one to every other root
        x[_MSGS] = ((world - 1) * is_dest + len(dests) - is_dest).max() if world > 1 else 0
        for d in dests:
            padded = world * matrix[:, d].max()
            x[1] += matrix[d, d]
            x[_COL["net" if (links[:, d] == 2).any() else "host"]] += padded
        return x
    for c, link in enumerate(LINKS):
        mask = links == c
        out_c = (matrix * mask).sum(axis=1)
        in_c = (matrix * mask).sum(axis=0)
        col = _COL[link]
        if link == "self":
            x[col] = out_c.max()
        else:  # one direction's bytes, and the bytes moving both ways at once
            x[col] = np.maximum(out_c, in_c).max()
            x[col + 1] = np.minimum(out_c, in_c).max()
    if strategy == "all_to_all":
        x[0] = 1.0
        x[_MSGS] = 2 * (world - 1)  # every peer, both ways, empty pairs included
    else:
        nz = (matrix > 0) & (links != 0)
        msgs = (nz.sum(axis=1) + nz.sum(axis=0)).max()
        pieces = 4 if strategy.startswith("chunked") else 1
        x[0] = x[_MSGS] = msgs * pieces
    return x


@dataclass
class BandwidthModel:
    """Coefficients per strategy, in :data:`FEATURES` order (seconds per call, message or byte).

    Attributes:
        coef: strategy name -> coefficient vector of ``len(FEATURES)``.
        source: where the numbers came from (one of :data:`SOURCES`): ``declared``
            (:meth:`declared`), ``calibrated`` (:func:`calibrate`), ``cache`` (:func:`load_cache`)
            or ``given`` (built by the caller).

    Raises:
        ConfigError: on a coefficient vector of the wrong length or an unknown source.

    Example::

        model = BandwidthModel.declared(150e-6, {"self": 8.0, "host": 1.5, "net": 0.1})
        name, seconds = model.choose(matrix_bytes, topo.link_matrix())
    """

    coef: dict[str, np.ndarray] = field(default_factory=dict)
    source: str = "given"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(
                f"BandwidthModel.source: expected one of {list(SOURCES)}, got {self.source!r}"
            )
        for name, c in self.coef.items():
            if np.shape(c) != (len(FEATURES),):
                raise ConfigError(
                    f"BandwidthModel.coef[{name!r}]: expected {len(FEATURES)} coefficients "
                    f"{list(FEATURES)}, got shape {np.shape(c)}"
                )

    def predict(self, strategy: str, matrix: np.ndarray, links: np.ndarray) -> float:
        """Predicted seconds of ``strategy`` on ``matrix``."""
        return float(features(strategy, matrix, links) @ self.coef[strategy])

    def choose(
        self, matrix: np.ndarray, links: np.ndarray, allowed=None, margin: float = TIE_MARGIN
    ) -> tuple[str, float]:
        """The strategy with the least predicted time, and that time.

        Ties go to the fused all-to-all: it is kept unless another strategy is predicted more
        than ``margin`` (relative) faster. Point-to-point's time on gloo varies far more from call
        to call than the fused collective's, so a small predicted gain is not worth its risk.
        """
        names = [n for n in self.coef if allowed is None or n in allowed]
        preds = {n: self.predict(n, matrix, links) for n in names}
        best = min(preds, key=preds.get)
        default = preds.get("all_to_all")
        if default is not None and preds[best] >= default * (1 - margin):
            return "all_to_all", default
        return best, preds[best]

    def to_json(self) -> dict[str, object]:
        """Plain JSON description."""
        return {n: c.tolist() for n, c in self.coef.items()}

    def describe(self) -> str:
        """One line for logs: the source, then per strategy (identical ones grouped) the latency
        per call and per message and the GB/s of every link class (``both``: the extra cost of
        bytes moving both ways at once, as GB/s; ``-``: free)."""
        groups: dict[tuple[float, ...], list[str]] = {}
        for name, c in self.coef.items():
            groups.setdefault(tuple(float(v) for v in c), []).append(name)
        parts = []
        for c, names in groups.items():
            x = dict(zip(FEATURES, c))
            links = ", ".join(
                f"{link} {_gbps(x[f'bytes_{link}'])} (both {_gbps(x[f'both_{link}'])})"
                for link in ("host", "net")
            )
            parts.append(
                f"{'/'.join(names)}: {x['calls'] * 1e6:.0f} us/call + {x['msgs'] * 1e6:.0f} us/msg,"
                f" self {_gbps(x['bytes_self'])}, {links} GB/s"
            )
        return f"bandwidth model ({self.source}): " + "; ".join(parts)

    @classmethod
    def declared(
        cls, latency_s: float, gbps: dict[str, float], message_s: float | None = None
    ) -> BandwidthModel:
        """A model from declared numbers (``calibrate=false``): the same numbers for every strategy.

        Strategies still price differently, by their own structure (:func:`features`): the fused
        all-to-all launches one call but puts a message on the wire for every peer, empty or not;
        point-to-point launches one call per non-empty peer and sends nothing else; a gather
        launches one call per destination, its root receiving from every rank, with chunks padded
        to the largest. So sparse or uneven matrices of small messages go point-to-point, one hot
        destination of small messages goes to gather, and large dense ones stay fused. Nothing
        declared tells chunked point-to-point's pipelining apart (it pays four times the calls for
        the same bytes): only a calibrated model picks it.

        Args:
            latency_s: seconds per collective call (launching it, its work, waiting for it).
            gbps: GB/s per link class ``self``, ``host``, ``net``. Within a host the CPU copies
                both directions (bytes moving both ways at once cost twice); a network link is
                full duplex.
            message_s: seconds per message on the wire at the critical rank; by default half a
                call (fitted on 2 loopback gloo ranks: ~77 us per message against ~125 us per
                call).

        Raises:
            ConfigError: on a missing link class, a bandwidth that is not positive, or a
                negative latency.
        """
        missing = [c for c in LINKS if c not in gbps]
        if missing:
            raise ConfigError(f"bandwidth.gbps: expected keys {list(LINKS)}, missing {missing}")
        bad = {c: gbps[c] for c in LINKS if not gbps[c] > 0}
        if bad:
            raise ConfigError(f"bandwidth.gbps: expected GB/s > 0 for every link, got {bad}")
        message_s = latency_s / 2 if message_s is None else message_s
        if latency_s < 0 or message_s < 0:
            raise ConfigError(
                f"bandwidth latency: expected seconds >= 0, got latency_s={latency_s}, "
                f"message_s={message_s}"
            )
        inv = {c: 1.0 / (gbps[c] * 1e9) for c in LINKS}
        vec = [latency_s, inv["self"], inv["host"], inv["host"], inv["net"], 0.0, message_s]
        return cls({n: np.array(vec) for n in NAMES}, "declared")


def _gbps(seconds_per_byte: float) -> str:
    return f"{1e-9 / seconds_per_byte:.3g}" if seconds_per_byte > 0 else "-"


def fit(samples: list[tuple[np.ndarray, float]]) -> np.ndarray:
    """Non-negative least squares on relative error: ``x @ coef ~= t`` for ``(x, t)`` samples.

    Features that are always zero (e.g. no cross-host bytes on one host) get coefficient 0, and
    so does a feature the samples cannot tell apart from earlier ones (a linear combination of
    them: at one world size the all-to-all's messages are a constant, like its one call), whose
    cost the earlier features carry.
    """
    X = np.array([x for x, _ in samples], dtype=np.float64)
    t = np.array([t for _, t in samples], dtype=np.float64)
    w = 1.0 / np.maximum(t, 1e-9)
    Xw = X * w[:, None]
    scale = np.linalg.norm(Xw, axis=0)
    active: list[int] = []
    for j in np.nonzero(scale > 0)[0]:
        cols = Xw[:, [*active, j]] / scale[[*active, j]]
        if np.linalg.matrix_rank(cols) == len(active) + 1:
            active.append(int(j))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(Xw[:, active], t * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))  # drop the most negative term and refit
    return coef


# ---------------------------------------------------------------------------- calibration

PROBE_SIZES = (1024, 16 * 1024, 256 * 1024, 2 * 1024 * 1024, 8 * 1024 * 1024)
PROBE_REPEATS = 7


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
    ex: Exchange, strategies: dict[str, Strategy], matrix: np.ndarray, repeats: int
) -> dict[str, float]:
    """Median seconds of every strategy moving ``matrix`` bytes (the slowest rank's).

    The strategies take turns within each repeat, as exchanges alternate with other collectives
    in a round (back-to-back calls of one strategy run warmer than it ever does in a round), and a
    noisy moment hits all of them alike. The first repeat is a warm-up.
    """
    me = ex.rank
    rows_out, rows_in = matrix[me].tolist(), matrix[:, me].tolist()
    inp = torch.randint(0, 255, (int(sum(rows_out)), 1), dtype=torch.uint8)
    out = torch.empty((int(sum(rows_in)), 1), dtype=torch.uint8)
    names = list(strategies)
    samples = torch.zeros(repeats + 1, len(names), dtype=torch.float64)
    for rep in range(repeats + 1):
        for j, name in enumerate(names):
            ex.barrier("probe")
            t0 = time.perf_counter()
            strategies[name].run(ex, out, inp, rows_in, rows_out, -1, "probe", matrix)
            samples[rep, j] = time.perf_counter() - t0
    if ex.world > 1:
        ex.run(
            lambda: dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=ex.group, async_op=True),
            "all_reduce(probe times)",
        )
    med = samples[1:].median(dim=0).values
    return {n: float(med[j]) for j, n in enumerate(names)}


def calibrate(
    ex: Exchange, topo: Topology, sizes=PROBE_SIZES, repeats=PROBE_REPEATS
) -> BandwidthModel:
    """Time every strategy at a few sizes and patterns, fit each (a collective: every rank).

    Runs as the phase ``start-up: calibrate``: every collective waits with the exchange's timeout.

    Raises:
        PhaseError: if a rank does not take part within the timeout (naming the ranks that never
            entered the phase, where the rendezvous store can tell).
    """
    strategies = make_strategies()
    links = topo.link_matrix()
    samples: dict[str, list[tuple[np.ndarray, float]]] = {n: [] for n in strategies}
    with ex.phase("start-up: calibrate"):
        for size in sizes:
            for matrix in probe_matrices(ex.world, size).values():
                for name, t in time_strategies(ex, strategies, matrix, repeats).items():
                    samples[name].append((features(name, matrix, links), t))
    return BandwidthModel({n: fit(s) for n, s in samples.items()}, "calibrated")


def cache_path(cache_dir: str, backend: str, topo: Topology) -> str:
    """Where the calibration of this backend, world size and host layout is cached."""
    return os.path.join(
        os.path.expanduser(cache_dir), f"bandwidth-{backend}-w{topo.world}-{topo.key()}.json"
    )


def load_cache(path: str, backend: str, topo: Topology) -> BandwidthModel | None:
    """The cached model, or ``None`` (with a warning) if missing, corrupt or for another layout."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != CACHE_VERSION or data.get("backend") != backend:
            raise ValueError(f"version/backend {data.get('version')}/{data.get('backend')}")
        if data.get("world") != topo.world or data.get("hosts") != topo.key():
            raise ValueError(f"layout world={data.get('world')} hosts={data.get('hosts')}")
        coef = {n: np.array(data["coef"][n], dtype=np.float64) for n in NAMES}
        if any(c.shape != (len(FEATURES),) or not np.isfinite(c).all() for c in coef.values()):
            raise ValueError("bad coefficient vector")
    except Exception as exc:
        log.warning("bandwidth cache %s ignored (%s); re-probing", path, exc)
        return None
    return BandwidthModel(coef, "cache")


def save_cache(path: str, model: BandwidthModel, backend: str, topo: Topology) -> None:
    """Write the model (atomically)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = {
        "version": CACHE_VERSION,
        "backend": backend,
        "world": topo.world,
        "hosts": topo.key(),
        "features": list(FEATURES),
        "coef": model.to_json(),
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


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
        flat = torch.tensor(np.concatenate([model.coef[n] for n in NAMES]), dtype=torch.float64)
        ex.run(
            lambda: dist.broadcast(flat, src=0, group=ex.group, async_op=True),
            "broadcast(coefficients)",
        )
    parts = flat.numpy().reshape(len(NAMES), len(FEATURES))
    return BandwidthModel({n: parts[i].copy() for i, n in enumerate(NAMES)}, model.source)


def build(
    ex: Exchange,
    topo: Topology,
    calibrate_now: bool,
    cache_dir: str | None,
    declared: BandwidthModel,
) -> tuple[BandwidthModel, float]:
    """The model every rank uses, and the seconds it took (cache, probe, or declared numbers).

    Every collective waits with the exchange's timeout (phases ``start-up: agree on the bandwidth
    model``, ``start-up: calibrate``, ``start-up: calibration cache``). Rank 0 logs the model's
    :meth:`~BandwidthModel.describe` line.

    Raises:
        PhaseError: if a rank does not take part in a phase within the timeout.
    """
    start = time.perf_counter()
    if not calibrate_now or ex.world == 1:
        model, seconds = declared, 0.0
    else:
        model = _agreed_model(ex, topo, cache_dir)
        seconds = time.perf_counter() - start
    if ex.rank == 0:
        log.info("%s (%.2fs)", model.describe(), seconds)
    return model, seconds


def _agreed_model(ex: Exchange, topo: Topology, cache_dir: str | None) -> BandwidthModel:
    """The cached model if every rank has it, else a fresh calibration (cached per host)."""
    backend = str(dist.get_backend(ex.group))
    path = cache_path(cache_dir, backend, topo) if cache_dir else None
    model = agree(ex, load_cache(path, backend, topo) if path else None)
    if model is None:
        model = agree(ex, calibrate(ex, topo))
        first_on_host = topo.host_of.index(topo.host_of[ex.rank]) == ex.rank
        if path and first_on_host:  # one writer per host
            save_cache(path, model, backend, topo)
        with ex.phase("start-up: calibration cache"):
            ex.barrier("cache written")  # the cache is complete before any rank looks again
    return model
