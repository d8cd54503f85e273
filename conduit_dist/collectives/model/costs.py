"""The bandwidth model itself: each strategy's predicted time for a byte matrix, and the choice.

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

A shaped network link (a token bucket: ``tc tbf``, a cloud NIC's burst allowance) passes a
rested burst at its line rate and the rest at its sustained rate, which no single per-byte
coefficient prices at both a round's tens of KB and a probe's MBs. A calibrated model may carry
a knee per strategy for it (:attr:`BandwidthModel.burst_bytes`, fitted by :func:`fit_burst`):
net bytes at the critical rank beyond the knee cost ``over_s[strategy]`` seconds per byte on
top of ``bytes_net``'s coefficient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from conduit_dist.collectives.strategies import NAMES
from conduit_dist.collectives.topology import LINKS
from conduit_dist.errors import ConfigError

# "msgs" is last so the byte columns keep their indices
FEATURES = ("calls", "bytes_self", "bytes_host", "both_host", "bytes_net", "both_net", "msgs")
_COL = {"self": 1, "host": 2, "net": 4}  # column of B_c; D_c (both directions) follows it
_MSGS = FEATURES.index("msgs")
_NET = FEATURES.index("bytes_net")
TIE_MARGIN = 0.15
SOURCES = ("declared", "calibrated", "cache", "given")


def features(strategy: str, matrix: np.ndarray, links: np.ndarray) -> np.ndarray:
    """The model's features (:data:`FEATURES`) of a strategy on a byte matrix.

    Args:
        strategy: a strategy name.
        matrix: ``[world, world]`` bytes from each source to each destination.
        links: ``[world, world]`` link class index (into ``LINKS``) of each pair (``self`` on
            the diagonal only, as ``Topology.link_matrix`` builds it).
    """
    world = matrix.shape[0]
    x = np.zeros(len(FEATURES))
    if strategy == "gather":
        is_dest = matrix.sum(axis=0) > 0
        dests = np.flatnonzero(is_dest)
        x[0] = len(dests)
        # each rank receives world-1 chunks as a root, and sends one to every other root
        x[_MSGS] = ((world - 1) * is_dest + len(dests) - is_dest).max() if world > 1 else 0
        padded = world * matrix[:, dests].max(axis=0)  # every chunk padded to the largest
        over_net = (links[:, dests] == 2).any(axis=0)  # a destination any rank reaches by net
        x[1] = matrix[dests, dests].sum()
        x[_COL["net"]], x[_COL["host"]] = padded[over_net].sum(), padded[~over_net].sum()
        return x
    # bytes out of and into each rank per link class: self is the diagonal, net the rest
    diag = np.diagonal(matrix)
    host = np.where(links == 1, matrix, 0)
    out_host, in_host = host.sum(axis=1), host.sum(axis=0)
    out_net, in_net = matrix.sum(axis=1) - diag - out_host, matrix.sum(axis=0) - diag - in_host
    x[_COL["self"]] = diag.max()
    for col, o, i in ((_COL["host"], out_host, in_host), (_COL["net"], out_net, in_net)):
        x[col] = np.maximum(o, i).max()  # one direction's bytes
        x[col + 1] = np.minimum(o, i).max()  # the bytes moving both ways at once
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
        burst_bytes: strategy name -> a shaped network link's knee (:func:`fit_burst`): the
            strategy's ``bytes_net`` it passes at its line rate after a rest.
        over_s: strategy name -> extra seconds per net byte beyond its ``burst_bytes`` (the
            sustained rate's cost over the line rate's). A strategy in neither: no knee.

    Raises:
        ConfigError: on a coefficient vector of the wrong length, an unknown source, or a knee
            that is negative or not finite.

    Example::

        model = BandwidthModel.declared(150e-6, {"self": 8.0, "host": 1.5, "net": 0.1})
        name, seconds = model.choose(matrix_bytes, topo.link_matrix())
    """

    coef: dict[str, np.ndarray] = field(default_factory=dict)
    source: str = "given"
    burst_bytes: dict[str, float] = field(default_factory=dict)
    over_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        knee = [*self.burst_bytes.values(), *self.over_s.values()]
        if set(self.burst_bytes) != set(self.over_s) or not all(
            np.isfinite(v) and v >= 0 for v in knee
        ):
            raise ConfigError(
                "BandwidthModel knee: expected burst_bytes and over_s for the same strategies, "
                f">= 0 and finite, got burst_bytes={self.burst_bytes!r}, over_s={self.over_s!r}"
            )
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
        return sum(self.terms(strategy, matrix, links).values())

    def terms(self, strategy: str, matrix: np.ndarray, links: np.ndarray) -> dict[str, float]:
        """Seconds of each term of ``strategy`` on ``matrix``: every feature's, and
        ``bytes_net_over_burst`` where the model has a knee."""
        x = features(strategy, matrix, links)
        out = dict(zip(FEATURES, (x * self.coef[strategy]).tolist(), strict=True))
        if strategy in self.over_s:
            over = max(0.0, float(x[_NET]) - self.burst_bytes[strategy])
            out["bytes_net_over_burst"] = over * self.over_s[strategy]
        return out

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
        knee = ""
        if self.over_s:  # the sustained rate beyond the burst, the fused all-to-all's
            name = "all_to_all" if "all_to_all" in self.over_s else next(iter(self.over_s))
            rate = _gbps(float(self.coef[name][_NET]) + self.over_s[name])
            kib = self.burst_bytes[name] / 1024
            knee = f"; net beyond a {kib:.0f} KiB burst {rate} GB/s ({name})"
        return f"bandwidth model ({self.source}): " + "; ".join(parts) + knee

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


BURST_GAIN = 0.5  # a knee is kept where it at least halves the probe's squared relative error


def _sse(samples: list[tuple[np.ndarray, float]], coef: np.ndarray) -> float:
    return float(sum(((x @ coef) / max(t, 1e-9) - 1.0) ** 2 for x, t in samples))


def fit_burst(
    samples: dict[str, list[tuple[np.ndarray, float]]],
) -> tuple[dict[str, np.ndarray], dict[str, float], dict[str, float]]:
    """Each strategy's coefficients (:func:`fit`), and a network knee where its probe shows one.

    A token-bucket link passes a rested burst at its line rate and what exceeds it at its
    sustained rate. For each strategy, every probed ``bytes_net`` below its two largest is
    tried as the knee (probes at or under it within the burst), refitting with one more column,
    the net bytes beyond the knee; the knee with the least squared relative error is kept where
    it at most :data:`BURST_GAIN` times the error without one (a plain link's probe gains
    little from a knee; a shaped one's several-fold). Each strategy has its own: their
    ``bytes_net`` count differently (a gather's chunks padded, per destination).

    Args:
        samples: strategy name -> ``(features, seconds)`` of the probe.

    Returns:
        ``(coef, burst_bytes, over_s)``: the knees by strategy, only where one is kept.
    """
    coef, burst, over = {}, {}, {}
    for name, got in samples.items():
        coef[name] = fit(got)
        best = _sse(got, coef[name]) * BURST_GAIN
        nets = sorted({float(x[_NET]) for x, _ in got if x[_NET] > 0})
        for knee in nets[:-2]:
            aug = [(np.append(x, max(0.0, x[_NET] - knee)), t) for x, t in got]
            c = fit(aug)
            err = _sse(aug, c)
            if err < best:
                best, coef[name], burst[name], over[name] = err, c[:-1], knee, float(c[-1])
    return coef, burst, over
