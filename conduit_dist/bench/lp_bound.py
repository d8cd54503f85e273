"""The best placement the bandwidth model admits, found by linear programming (bench only).

For a declared topology and workload this searches placements that keep every shard's data
equally fresh (each shard that stores anything receives the same share of a round's items, as one
global FIFO would; a shard fed a trickle fills up just the same and then holds stale data). For
each candidate *support* ``S`` (the shards that store data) the steady-state delivery is fixed:
every shard in ``S`` is full, the sampler draws from them. What is left is a transportation
problem: route each source's items to ``S``, every shard in ``S`` taking ``total / |S|``, at the
least predicted ingest time. The model's ingest time (per link class, the bytes on the busiest
rank) is a maximum of linear terms, so that is a linear program; the per-call latency is added
where the support forces a transfer between ranks.

Supports are enumerated node-symmetrically: ranks are grouped by (ranks on their host, role,
items put) and every host of a group stores on the same number of its ranks. The result is the
best plan over those supports, a reference for the planner, not a proof over every placement.
The LP weighs bytes only (messages are priced afterwards, on its routing), so a routing onto the
same support with fewer messages can price lower: the planner's packed plans
(:mod:`conduit_dist.placement.packed`) do on some topologies.
Needs SciPy (the ``bench`` extra).
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy.optimize import linprog  # the bench extra; bench.placement skips the LP without it
from scipy.sparse import coo_matrix

from conduit_dist.collectives.model import BandwidthModel
from conduit_dist.collectives.topology import Topology
from conduit_dist.registry import bound_sampler


def _ingest_lp(model: BandwidthModel, links: np.ndarray, staged: np.ndarray, S: list[int], rb: int):
    """Least predicted ingest seconds routing ``staged`` onto ``S`` with equal inflow.

    Priced by the all-to-all's linear terms only: a shaped link's burst knee
    (``BandwidthModel.burst_bytes``) is not in the LP, so on such a link the bound is a line
    rate's (one host, the bench's setting, has no knee)."""
    coef = model.coef["all_to_all"] * 1e6  # microseconds: keeps the solver's tolerances meaningful
    srcs = np.nonzero(staged)[0]
    ns, nd = len(srcs), len(S)
    nv = ns * nd
    t_self, t_host, t_net = nv, nv + 1, nv + 2
    cost = np.zeros(nv + 3)
    cost[[t_self, t_host, t_net]] = 1.0
    cls = links[np.ix_(srcs, S)]  # link class of each variable
    var = np.arange(nv).reshape(ns, nd)
    rows, cols, vals, rhs = [], [], [], []
    r = 0

    def bound_by(t: int, idx: np.ndarray, scale: float) -> None:  # scale * sum(x[idx]) <= t
        nonlocal r
        if idx.size == 0 or scale == 0:
            return
        rows.extend([r] * (idx.size + 1))
        cols.extend([*idx.tolist(), t])
        vals.extend([*([scale] * idx.size), -1.0])
        rhs.append(0.0)
        r += 1

    for rank in range(links.shape[0]):
        out_rows = srcs == rank
        in_cols = np.asarray(S) == rank
        for c, t, one, both in ((1, t_host, coef[2], coef[3]), (2, t_net, coef[4], coef[5])):
            out_idx = var[out_rows][cls[out_rows] == c]
            in_idx = var[:, in_cols][cls[:, in_cols] == c]
            bound_by(t, out_idx, rb * one)
            bound_by(t, in_idx, rb * one)
            bound_by(t, np.concatenate([out_idx, in_idx]), rb * both)  # both ways at once
        bound_by(t_self, var[out_rows][cls[out_rows] == 0], rb * coef[1])
    a_ub = coo_matrix((vals, (rows, cols)), shape=(r, nv + 3)).tocsr()
    eq_rows = np.concatenate([np.repeat(np.arange(ns), nd), ns + np.tile(np.arange(nd), ns)])
    a_eq = coo_matrix(
        (np.ones(2 * nv), (eq_rows, np.concatenate([var.ravel(), var.ravel()]))),
        shape=(ns + nd, nv + 3),
    ).tocsr()
    b_eq = np.concatenate([staged[srcs], np.full(nd, staged.sum() / nd)])
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(r), A_eq=a_eq, b_eq=b_eq, method="highs")
    if not res.success:
        raise RuntimeError(f"ingest LP failed: {res.message}")
    # price the LP's routing as the planner prices a plan: the model's choice of strategy, with
    # its per-call and per-message terms (the LP itself weighs the bytes only)
    plan = np.zeros(links.shape)
    plan[np.ix_(srcs, S)] = res.x[:nv].reshape(ns, nd)
    return model.choose(plan * rb, links)[1] if plan.any() else 0.0


def best_balanced(
    model: BandwidthModel,
    topo: Topology,
    learners: np.ndarray,
    staged: np.ndarray,
    requests: np.ndarray,
    record_bytes: int,
    sampling: str,
    capacity: float = np.inf,
) -> tuple[float, dict[str, int]]:
    """Predicted seconds (ingest + steady-state delivery) of the best equal-inflow placement.

    A support whose shards would each take more than ``capacity`` items a round is left out: no
    placement may put more in a shard in one round than it holds (the planner's rule too).

    Args:
        model: the bandwidth model.
        topo: the topology (hosts of every rank).
        learners: ``[world]`` bool, ranks that fetch.
        staged: ``[world]`` items each rank puts per round.
        requests: ``[world]`` batch size of each rank.
        record_bytes: bytes per item.
        sampling: a sampler name (``uniform`` or ``stratified``).
        capacity: items one shard holds.

    Returns:
        ``(seconds, support)``: the best time and, per rank group, how many ranks of each host
        store data.
    """
    links, world = topo.link_matrix(), topo.world
    hosts = np.asarray(topo.host_of)
    groups: dict[tuple[int, bool, int], list[list[int]]] = {}
    for h in np.unique(hosts):
        ranks = np.nonzero(hosts == h)[0]
        for role in (True, False):
            for amount in np.unique(staged[ranks]):
                sel = [int(x) for x in ranks if learners[x] == role and staged[x] == amount]
                if sel:
                    groups.setdefault((len(ranks), role, int(amount)), []).append(sel)
    kinds = list(groups)
    sampler = bound_sampler(sampling, links)
    best = (np.inf, {})
    for counts in itertools.product(*[range(len(groups[k][0]) + 1) for k in kinds]):
        S = sorted(r for k, j in zip(kinds, counts) for sel in groups[k] for r in sel[:j])
        if not S or staged.sum() / len(S) > capacity:
            continue
        sizes = np.zeros(world)
        sizes[S] = 10_000.0  # full shards (only the proportions matter)
        deliver_counts = sampler.expected(requests, sizes)
        deliver = model.choose(deliver_counts.T * record_bytes, links)[1]
        t = deliver + _ingest_lp(model, links, staged.astype(np.float64), S, record_bytes)
        if t < best[0]:
            support = {
                f"{'learner' if k[1] else 'actor'}/{k[0]}/{k[2]}": j for k, j in zip(kinds, counts)
            }
            best = (t, support)
    return best
