"""Draw docs/img/token_round.png: one token round carrying ragged prompt groups.

Command::

    python scripts/draw_tokens.py

Three ranks (each a producer and a learner) hold prompt groups of G = 4 sequences of different
lengths in their token arenas; the round all-gathers the group table, the real planner
(``conduit_dist.tokens.balance.plan``) divides the complete groups over the learners by tokens
(Karmarkar-Karp) and each learner's share into the same number of micro-batches under the token
budget, and a learner's micro-batch arrives packed with ``cu_seqlens`` (no padding), drawn beside
the padded alternative. No process group is needed: the plan is pure and deterministic.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

from conduit_dist.tokens.balance import plan

OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "token_round.png"
G = 4
BUDGET = 1600
# rank -> [(group id, [sequence lengths])]; the last group on rank 2 is still generating
RANKS = {
    0: [(10, [412, 96, 530, 241]), (11, [120, 188, 75, 301]), (12, [590, 455, 512, 380])],
    1: [(20, [260, 330, 48, 415]), (21, [480, 155, 92, 270])],
    2: [(30, [350, 600, 210, 125]), (31, [66, 140, 385, 230]), (32, [300, 170])],
}
VERSION = {10: 6, 11: 6, 12: 7, 20: 6, 21: 7, 30: 7, 31: 7, 32: 7}
LEARNERS = 3
COLORS = plt.get_cmap("tab10").colors


def _complete() -> list[tuple[int, int, list[int]]]:
    """(rank, group id, lengths) of every complete group, in the gathered table's order."""
    return [(r, g, ls) for r, gs in RANKS.items() for g, ls in gs if len(ls) == G]


def _color(gid: int) -> tuple[float, float, float]:
    order = [g for gs in RANKS.values() for g, _ in gs]
    return COLORS[order.index(gid) % len(COLORS)]


def _header(ax, x: float, y: float, text: str) -> None:
    ax.text(x, y, text, fontsize=9, fontweight="bold", va="bottom")


def _arenas(ax, x0: float, x1: float, top: float, bottom: float) -> None:
    """Each rank's groups: one bar per sequence (length in tokens), and its arena strip."""
    scale = (x1 - x0 - 9) / 620  # tokens -> x units for the sequence bars
    heights = {r: sum(len(ls) for _, ls in gs) + 0.8 * len(gs) + 4.0 for r, gs in RANKS.items()}
    unit = (top - bottom - 1.2 * (len(RANKS) - 1)) / sum(heights.values())
    y = top
    for r, gs in RANKS.items():
        h = heights[r] * unit
        ax.add_patch(Rectangle((x0, y - h), x1 - x0, h, fc="#f4f4f4", ec="#888", lw=0.8))
        ax.text(x0 + 0.6, y - 1.1, f"rank {r}", fontsize=8, fontweight="bold", va="center")
        yy = y - 2.0 * unit - 0.6
        for gid, lengths in gs:
            done = len(lengths) == G
            ax.text(
                x0 + 0.6,
                yy - len(lengths) * unit * 0.5,
                f"g{gid}\nv{VERSION[gid]}" if done else f"g{gid}\n{len(lengths)}/{G}",
                fontsize=6.5,
                va="center",
                color="black" if done else "#777",
            )
            for ln in lengths:
                ax.add_patch(
                    Rectangle(
                        (x0 + 4.5, yy - unit * 0.85),
                        ln * scale,
                        unit * 0.75,
                        fc=_color(gid) if done else "white",
                        ec=_color(gid),
                        lw=0.6,
                        ls="-" if done else "--",
                    )
                )
                ax.text(x0 + 4.7 + ln * scale, yy - unit * 0.48, str(ln), fontsize=5.5, va="center")
                yy -= unit
            yy -= 0.8 * unit
        # the arena: every sequence a contiguous run, no padding
        total = sum(sum(ls) for _, ls in gs)
        ax.text(x0 + 0.6, y - h + 0.75 * unit, "arena", fontsize=6, va="center", color="#444")
        ax.text(x1 - 0.5, y - h + 1.75 * unit, f"{total} tokens", fontsize=6, ha="right")
        ax_scale = (x1 - x0 - 5) / 5200
        xx = x0 + 4.5
        for gid, lengths in gs:
            for ln in lengths:
                ax.add_patch(
                    Rectangle(
                        (xx, y - h + 0.35 * unit),
                        ln * ax_scale,
                        0.8 * unit,
                        fc=_color(gid),
                        ec="white",
                        lw=0.3,
                        alpha=1.0 if len(lengths) == G else 0.35,
                    )
                )
                xx += ln * ax_scale
        y -= h + 1.2


def _table(ax, x0: float, top: float) -> float:
    """The all-gathered group table: one row per group, the same on every rank."""
    cols = ["rank", "group", "tokens", "seqs", "ver"]
    xs = [x0, x0 + 3.6, x0 + 7.6, x0 + 12.2, x0 + 15.6]
    for x, c in zip(xs, cols):
        ax.text(x, top, c, fontsize=7, fontweight="bold")
    y = top - 2.2
    for r, gs in RANKS.items():
        for gid, lengths in gs:
            done = len(lengths) == G
            vals = [r, f"g{gid}", sum(lengths), f"{len(lengths)}/{G}", VERSION[gid]]
            ax.add_patch(
                Rectangle(
                    (x0 - 0.6, y - 0.75), 19.4, 2.0, fc=_color(gid), alpha=0.22 if done else 0
                )
            )
            for x, v in zip(xs, vals):
                ax.text(x, y, str(v), fontsize=7, color="black" if done else "#888")
            if not done:
                ax.text(
                    x0 + 9.5,
                    y - 1.9,
                    "(waits for its members)",
                    fontsize=6,
                    color="#888",
                    ha="center",
                )
            y -= 2.6
    return y


def _stack(ax, x: float, y: float, h: float, gids, tokens, scale: float) -> float:
    """A horizontal stack of groups (width by tokens); returns the right edge."""
    for gid, t in zip(gids, tokens):
        w = t * scale
        ax.add_patch(Rectangle((x, y), w, h, fc=_color(gid), ec="white", lw=1.0))
        if w > 3.2:
            ax.text(x + w / 2, y + h / 2, f"g{gid}", fontsize=6.5, ha="center", va="center")
        x += w
    return x


def draw() -> Path:
    """Draw the picture; returns its path."""
    groups = _complete()
    tokens = [sum(ls) for _, _, ls in groups]
    gids = [g for _, g, _ in groups]
    shares = plan(tokens, LEARNERS, BUDGET)  # the real planner: plan[learner][micro]
    count = len(shares[0])
    assert all(len(s) == count for s in shares) and all(m for s in shares for m in s)

    fig = plt.figure(figsize=(12, 7), dpi=110)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 120)
    ax.set_ylim(0, 70)
    ax.axis("off")
    ax.text(
        60,
        68.3,
        f"One token round carrying ragged prompt groups: 3 ranks, each a producer and a learner "
        f"(G = {G} sequences per group, token_budget = {BUDGET})",
        fontsize=11,
        ha="center",
        va="center",
    )

    top = 63.5
    _header(ax, 0.6, top + 0.6, "1. put: each rank's token arena")
    _arenas(ax, 0.6, 27.5, top, 24.0)

    _header(ax, 30, top + 0.6, "2. all-gather: group table")
    end = _table(ax, 30.6, top - 1.6)
    ax.text(
        30.3,
        end - 1.6,
        "identical on every rank:\nselect, plan and the exchange's\n"
        "byte matrix need no further\nmessage",
        fontsize=6.5,
        va="top",
        color="#444",
    )

    # 3. Karmarkar-Karp over the learners
    x0 = 52
    _header(ax, x0, top + 0.6, f"3. plan: Karmarkar-Karp, {LEARNERS} learners")
    scale = 26 / max(sum(tokens[i] for m in s for i in m) for s in shares)
    for li, s in enumerate(shares):
        y = top - 5 - li * 6.5
        flat = [i for m in s for i in m]
        ax.text(x0, y + 1.0, f"learner {li}", fontsize=7.5, va="center")
        right = _stack(
            ax, x0 + 6, y, 2.0, [gids[i] for i in flat], [tokens[i] for i in flat], scale
        )
        ax.text(right + 0.5, y + 1.0, f"{sum(tokens[i] for i in flat)}", fontsize=7, va="center")
    ax.text(
        x0,
        top - 23.5,
        "whole groups (never split), heaviest-spread tuples merged first;\n"
        "fewer groups than learners is refused",
        fontsize=6.5,
        va="top",
        color="#444",
    )

    # 4. micro-batches under the budget
    x0 = 89
    _header(ax, x0, top + 0.6, f"4. micro-batches: M = {count} per learner")
    mscale = 19 / max(BUDGET, max(tokens))
    for li, s in enumerate(shares):
        for k, mb in enumerate(s):
            y = top - 4.2 - li * 7.2 - k * 2.8
            ax.text(x0, y + 1.0, f"L{li} mb {k}", fontsize=7, va="center")
            ax.text(
                x0 + 9.3,
                y + 1.1,
                str(sum(tokens[i] for i in mb)),
                fontsize=6.5,
                va="center",
                ha="right",
            )
            _stack(ax, x0 + 10, y, 2.2, [gids[i] for i in mb], [tokens[i] for i in mb], mscale)
    ybot, ytop = top - 4.2 - (LEARNERS - 1) * 7.2 - (count - 1) * 2.8 - 0.6, top - 1.2
    ax.plot([x0 + 10 + BUDGET * mscale] * 2, [ybot, ytop], ls="--", color="crimson", lw=1)
    ax.text(
        x0 + 10 + BUDGET * mscale,
        ybot - 1.2,
        f"budget {BUDGET}",
        fontsize=6.5,
        color="crimson",
        ha="center",
    )
    ax.text(
        x0,
        ybot - 3.2,
        "same count everywhere, none empty;\na group over the budget rides alone",
        fontsize=6.5,
        va="top",
        color="#444",
    )

    for xa, xb in ((27.9, 29.6), (49.6, 51.6), (84.2, 88.4)):
        ax.add_patch(
            FancyArrowPatch((xa, top - 8), (xb, top - 8), arrowstyle="-|>", mutation_scale=12)
        )

    # 5. learner 0's first micro-batch: packed with cu_seqlens, and padded
    li, k = next((li, k) for li, s in enumerate(shares) for k, m in enumerate(s) if len(m) > 1)
    mb = shares[li][k]
    seqs = [(gids[i], ln) for i in mb for ln in groups[i][2]]
    holders = sorted({groups[i][0] for i in mb})
    n, width = len(seqs), max(ln for _, ln in seqs)
    total = sum(ln for _, ln in seqs)
    _header(ax, 0.6, 20.6, f"5. learner {li}, micro-batch {k} arrives packed: no padding")
    px0, pw = 1.0, 72.0
    sc = pw / total
    x, cu = px0, [0]
    for gid, ln in seqs:
        ax.add_patch(Rectangle((x, 12.5), ln * sc, 4.0, fc=_color(gid), ec="white", lw=1.2))
        x += ln * sc
        cu.append(cu[-1] + ln)
    for j, c in enumerate(cu):
        xc = px0 + c * sc
        ax.plot([xc, xc], [11.7, 12.5], color="black", lw=0.8)
        ax.text(xc, 10.9 - 1.3 * (j % 2), str(c), fontsize=6.5, ha="center", va="center")
    ax.text(px0, 7.3, f"cu_seqlens (int32, {n} sequences + 1)", fontsize=7, color="#444")
    ax.text(
        px0,
        5.4,
        f'mb["tokens"]: [{total}]  ·  max_seqlen = {width}  ·  mb.tokens = {total}  ·  '
        f"mb.sequences = {n}\n"
        f"sequence i is packed[cu_seqlens[i]:cu_seqlens[i + 1]] (varlen attention's input); "
        f"its holders (ranks {', '.join(map(str, holders))}) sent it in the round's one exchange",
        fontsize=7,
        va="top",
    )

    # the padded alternative: mb.padded()
    qx0, qw, rh = 80.0, 26.0, 1.9
    padded = n * width
    _header(ax, qx0, 20.6, "the padded alternative: mb.padded()")
    for r, (gid, ln) in enumerate(seqs):
        y = 19.6 - (r + 1) * rh
        ax.add_patch(Rectangle((qx0, y), ln / width * qw, rh * 0.85, fc=_color(gid), lw=0))
        ax.add_patch(
            Rectangle(
                (qx0 + ln / width * qw, y),
                (width - ln) / width * qw,
                rh * 0.85,
                fc="white",
                ec="#bbb",
                hatch="////",
                lw=0.4,
            )
        )
    ax.text(
        qx0 + qw + 1,
        19.6 - n * rh / 2,
        f"[{n}, {width}]\n= {padded} slots\n{padded - total} of them\npadding "
        f"({(padded - total) / padded:.0%})",
        fontsize=7,
        va="center",
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    plt.close(fig)
    return OUT


if __name__ == "__main__":
    print(draw())
