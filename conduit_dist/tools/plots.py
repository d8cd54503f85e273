"""The report's plots: one function per PNG, each ``None`` when the run logged none of what it
draws (``conduit_dist/tools/report.py`` draws them; ``python -m conduit_dist.report RUN_DIR``)."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from conduit_dist.collectives.topology import LINKS

Rows = list[dict[str, Any]]


def series(rows: Rows, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(env_steps, values)`` of the rows that hold a number for ``key``."""
    pts = [(r["env_steps"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    arr = np.array(pts, dtype=np.float64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def _has(rows: Rows, *keys: str) -> bool:
    return all(any(isinstance(r.get(k), int | float) for r in rows) for k in keys)


def _figure(title: str, ylabel: str, xlabel: str = "env steps (all ranks)"):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, out: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_return(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    key = "rl/episode_return_100"
    if not _has(rows, key):
        return None
    x, y = series(rows, key)
    target = info.get("config", {}).get("target_return")
    fig, ax = _figure(f"Return (mean of the last 100 episodes), best {y.max():.1f}", "return")
    ax.plot(x, y, color="tab:blue", label="last-100 mean")
    if target is not None:
        ax.axhline(target, color="tab:red", ls="--", lw=1, label=f"target {target:g}")
        hit = np.nonzero(y >= target)[0]
        if hit.size:
            ax.axvline(x[hit[0]], color="tab:red", ls=":", lw=1)
    ax.legend(loc="lower right")
    return _save(fig, out, "return.png")


def xlabel(info: dict[str, Any]) -> str:
    """GRPO's x axis counts trained responses, the others' env steps."""
    grpo = info.get("config", {}).get("algo", {}).get("name") == "grpo"
    return "responses trained (all learners)" if grpo else "env steps (all ranks)"


def _plot_reward(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    key = "rl/reward"
    if not _has(rows, key):
        return None
    x, y = series(rows, key)
    fig, ax = _figure(f"Mean reward of the consumed responses, last {y[-1]:.2f}", "reward",
                      xlabel(info))  # fmt: skip
    ax.plot(x, y, color="tab:blue", label="per log window")
    if _has(rows, "rl/exact"):
        ax.plot(*series(rows, "rl/exact"), color="tab:green", alpha=0.7, label="exact answers")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower left")
    if _has(rows, "rl/response_len"):
        twin = ax.twinx()
        twin.plot(*series(rows, "rl/response_len"), color="tab:gray", ls="--", lw=1)
        twin.set_ylabel("response length, tokens (dashed)")
        twin.set_ylim(bottom=0)
    return _save(fig, out, "reward.png")


def _plot_tokens(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    kg, kt = "rate/gen_tokens_per_s", "rate/train_tokens_per_s"
    if not _has(rows, kg, kt):
        return None
    fig, ax = _figure("Tokens per second (all ranks)", "tokens / s", xlabel(info))
    ax.plot(
        *series(rows, kg),
        color="tab:orange",
        label="response tokens generated (counted as consumed)",
    )
    ax.plot(*series(rows, kt), color="tab:blue", label="tokens trained (prompt + response)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    return _save(fig, out, "tokens.png")


def _plot_policy_age(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    km, kx = "path/policy_age_mean", "path/policy_age_max"
    if not _has(rows, km, kx) or not _has(rows, "rl/reward"):
        return None
    fig, ax = _figure("Policy age of the consumed responses", "versions", xlabel(info))
    ax.plot(*series(rows, km), color="tab:blue", label="mean")
    ax.step(*series(rows, kx), color="tab:red", where="post", label="max")
    bound = info.get("config", {}).get("algo", {}).get("grpo", {}).get("max_policy_age")
    if bound is not None:
        ax.axhline(bound, color="black", ls=":", lw=1, label=f"max_policy_age {bound}")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    return _save(fig, out, "policy_age.png")


def _plot_weights(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    kp, kt = "weights/pack_ms", "weights/transfer_ms"
    if not _has(rows, kp, kt):
        return None
    fig, ax = _figure("Weights published per version (the logging learner)", "ms", xlabel(info))
    x, pack = series(rows, kp)
    _, xfer = series(rows, kt)
    ax.stackplot(x, pack, xfer, labels=["pack (publish_weights)", "transfer (its round)"],
                 colors=["tab:orange", "tab:blue"], alpha=0.8)  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    return _save(fig, out, "weights.png")


def _plot_path_time(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    ke, kh = "path/exposed_ms_mean", "path/hidden_ms_mean"
    if not _has(rows, ke, kh):
        return None
    x, exposed = series(rows, ke)
    hidden = np.array([r.get(kh) or 0.0 for r in rows if isinstance(r.get(ke), int | float)])
    share = hidden.sum() / max(hidden.sum() + exposed.sum(), 1e-12)
    grpo = xlabel(info) != "env steps (all ranks)"
    unit = "global batch" if grpo else "fetch"
    fig, ax = _figure(
        f"Experience path per learner {unit}: {share:.0%} of "
        + ("generation and rounds" if grpo else "the round")
        + " hidden",
        f"ms per {unit}",
        xlabel(info),
    )
    ax.stackplot(
        x, exposed, hidden, labels=["exposed (the learner waited)", "hidden (behind compute)"],
        colors=["tab:red", "tab:green"], alpha=0.7,
    )  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    return _save(fig, out, "path_time.png")


def _plot_link_bytes(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    keys = [f"path/bytes_{c}" for c in LINKS]
    if not _has(rows, *keys):
        return None
    fig, ax = _figure("Bytes the rounds sent, by link class (all ranks)", "cumulative MB")
    for key, link, color in zip(keys, LINKS, ("tab:gray", "tab:blue", "tab:orange")):
        x, y = series(rows, key)
        total = np.cumsum(y) / 1e6
        ax.plot(x, total, color=color, label=f"{link}: {total[-1]:,.1f} MB" if total.size else link)
    ax.legend(loc="upper left")
    return _save(fig, out, "link_bytes.png")


_TIER = re.compile(r"^store/tier(\d+)_(\w+)_bytes$")


def _plot_store_tiers(rows: Rows, info: dict[str, Any], out: str) -> str | None:
    found = {k for r in rows for k in r if _TIER.match(k)}
    keys = sorted(found, key=lambda k: int(_TIER.match(k)[1]))
    if not keys:
        return None
    fig, ax = _figure("Store size per tier (mean over shards)", "MB per shard")
    x = np.array([r["env_steps"] for r in rows], dtype=np.float64)
    ys = [np.array([(r.get(k) or 0.0) / 1e6 for r in rows]) for k in keys]
    labels = [f"tier {m[1]} ({m[2]})" for m in (_TIER.match(k) for k in keys)]
    ax.stackplot(x, *ys, labels=labels, alpha=0.7)
    ax.legend(loc="upper left")
    return _save(fig, out, "store_tiers.png")


PLOTS = (
    ("return.png", _plot_return, "rl/episode_return_100"),
    ("reward.png", _plot_reward, "rl/reward"),
    ("tokens.png", _plot_tokens, "rate/gen_tokens_per_s and rate/train_tokens_per_s"),
    ("policy_age.png", _plot_policy_age, "rl/reward and path/policy_age_{mean,max}"),
    ("path_time.png", _plot_path_time, "path/exposed_ms_mean and path/hidden_ms_mean"),
    ("weights.png", _plot_weights, "weights/pack_ms and weights/transfer_ms"),
    ("link_bytes.png", _plot_link_bytes, "path/bytes_{self,host,net}"),
    ("store_tiers.png", _plot_store_tiers, "store/tier<i>_<kind>_bytes"),
)
