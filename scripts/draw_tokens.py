"""Draw docs/img/token_round.png: one token round carrying ragged prompt groups.

Command::

    python scripts/draw_tokens.py

Three ranks (each a producer and a learner) hold prompt groups of G = 4 sequences of different
lengths in their token arenas; one group is still generating. The round all-gathers the group
table; the real selection (``conduit_dist.tokens.select.consume``: oldest version first, then
completion order) picks the complete groups, the real planner (``conduit_dist.tokens.balance.plan``)
divides them over the learners by tokens (Karmarkar-Karp) and each learner's share into the same
number of micro-batches under the token budget; the exchange's sections (holder x learner) and
their bytes come from the table (``conduit_dist.tokens.wire.Wire``), and a learner's micro-batch
arrives packed with ``cu_seqlens`` (no padding), drawn beside its padded form (``mb.padded()``).
No process group is needed: selection, plan and sizes are pure functions of the table.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

from conduit_dist.tokens import select as S
from conduit_dist.tokens.balance import plan
from conduit_dist.tokens.spec import Ragged, TokenSpec
from conduit_dist.tokens.wire import Wire

OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "token_round.png"
G = 4
BUDGET = 1600
LEARNERS = 3
NEWEST, MAX_AGE = 7, 1  # the first learner's version and max_policy_age
# rank -> [(group id, [sequence lengths])], in arrival order; rank 2's g32 is still generating
RANKS = {
    0: [(10, [412, 96, 530, 241]), (11, [120, 188, 75, 301]), (12, [590, 455, 512, 380])],
    1: [(20, [260, 330, 48, 415]), (21, [480, 155, 92, 270])],
    2: [(30, [350, 600, 210, 125]), (31, [66, 140, 385, 230]), (32, [300, 170])],
}
VERSION = {10: 6, 11: 6, 12: 7, 20: 6, 21: 7, 30: 7, 31: 7, 32: 7}
SPEC = TokenSpec(
    {
        "tokens": Ragged(torch.int32, 1024),
        "logprobs": Ragged(torch.float32, 1024),
        "reward": ((), torch.float32),
    },
    group_size=G,
)
COLORS = plt.get_cmap("tab10").colors
GREY = "#444"


def _table() -> tuple[S.Groups, list[list[int]]]:
    """The gathered group table (rank-major, as ``select.gather_tables`` builds it) and each
    row's sequence lengths."""
    rows, rank, lengths = [], [], []
    for r, gs in RANKS.items():
        arrived = 0
        for gid, ls in gs:
            arrived += len(ls)
            order = arrived if len(ls) == G else S.PENDING  # completion order, or pending
            prio = int(np.float64(1.0).view(np.int64))
            rows.append([gid, sum(ls), len(ls), VERSION[gid], order, prio])
            rank.append(r)
            lengths.append(ls)
    return S.Groups(np.array(rank), np.array(rows, dtype=np.int64)), lengths


def _color(gid: int) -> tuple[float, float, float]:
    order = [g for gs in RANKS.values() for g, _ in gs]
    return COLORS[order.index(gid) % len(COLORS)]


def _header(ax, x: float, y: float, text: str) -> None:
    ax.text(x, y, text, fontsize=9, fontweight="bold", va="bottom")


def _note(ax, x: float, y: float, text: str, **kw) -> None:
    ax.text(x, y, text, fontsize=6.8, va="top", color=GREY, **kw)


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
        ax.text(x0 + 0.6, y - h + 0.75 * unit, "arena", fontsize=6, va="center", color=GREY)
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


def _gathered(ax, groups: S.Groups, chosen: np.ndarray, x0: float, top: float) -> float:
    """The all-gathered group table: one row per group, the same on every rank; the selected
    groups' delivery position on the right."""
    cols = ["rank", "group", "tokens", "seqs", "ver", "pick"]
    xs = [x0, x0 + 3.4, x0 + 7.2, x0 + 11.5, x0 + 14.8, x0 + 17.6]
    for x, c in zip(xs, cols, strict=True):
        ax.text(x, top, c, fontsize=7, fontweight="bold")
    pos = {int(c): k for k, c in enumerate(chosen)}
    y = top - 2.2
    for i, (r, row) in enumerate(zip(groups.rank, groups.table, strict=True)):
        gid, done = int(row[S.GID]), int(row[S.ORDER]) >= 0
        pick = f"#{pos[i] + 1}" if i in pos else "-"
        vals = [r, f"g{gid}", row[S.TOKENS], f"{row[S.MEMBERS]}/{G}", row[S.VERSION], pick]
        ax.add_patch(
            Rectangle((x0 - 0.6, y - 0.75), 21.2, 2.0, fc=_color(gid), alpha=0.22 if done else 0)
        )
        for x, v in zip(xs, vals, strict=True):
            ax.text(x, y, str(v), fontsize=7, color="black" if done else "#888")
        if not done:
            _note(ax, x0 + 10, y - 1.1, "(waits for its members)", ha="center")
        y -= 2.6
    return y


def _stack(ax, x: float, y: float, h: float, gids, tokens, scale: float) -> float:
    """A horizontal stack of groups (width by tokens); returns the right edge."""
    for gid, t in zip(gids, tokens, strict=True):
        w = t * scale
        ax.add_patch(Rectangle((x, y), w, h, fc=_color(gid), ec="white", lw=1.0))
        if w > 3.2:
            ax.text(x + w / 2, y + h / 2, f"g{gid}", fontsize=6.5, ha="center", va="center")
        x += w
    return x


def _sections(holder, members, tokens, shares) -> tuple[np.ndarray, np.ndarray]:
    """Sequences and tokens each holder sends each learner (as ``round._deliver`` counts)."""
    n = np.zeros((len(RANKS), LEARNERS), np.int64)
    t = np.zeros((len(RANKS), LEARNERS), np.int64)
    for li, mbs in enumerate(shares):
        for i in (i for mb in mbs for i in mb):
            n[holder[i], li] += members[i]
            t[holder[i], li] += tokens[i]
    return n, t


def draw() -> Path:
    """Draw the picture; returns its path."""
    groups, lengths = _table()
    none = np.zeros(len(groups.rank), dtype=bool)
    want = int(groups.complete.sum())  # a fetch of every complete group
    chosen = S.consume(groups, want, LEARNERS, want, NEWEST, MAX_AGE, none)
    tokens = [int(t) for t in groups.tokens[chosen]]
    gids = [int(g) for g in groups.table[chosen, S.GID]]
    holder = [int(r) for r in groups.rank[chosen]]
    members = [int(m) for m in groups.table[chosen, S.MEMBERS]]
    seqlens = [lengths[c] for c in chosen]
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
    _header(ax, 0.6, top + 0.6, "put: each rank's token arena")
    _arenas(ax, 0.6, 27.5, top, 24.0)

    _header(ax, 29.6, top + 0.6, "1. meta: the group table")
    end = _gathered(ax, groups, chosen, 30.2, top - 1.6)
    _note(
        ax,
        29.9,
        end - 0.6,
        "one all-gather: the same table on every rank\n"
        "(2. weights: none here, every rank learns).\n"
        f"3. select (learner's version {NEWEST}):\noldest version first, then completion order",
    )

    # 4. Karmarkar-Karp over the learners
    x0 = 54
    _header(ax, x0, top + 0.6, f"4. plan: Karmarkar-Karp, {LEARNERS} learners")
    scale = 21 / max(sum(tokens[i] for m in s for i in m) for s in shares)
    for li, s in enumerate(shares):
        y = top - 5 - li * 6.5
        flat = [i for m in s for i in m]
        ax.text(x0, y + 1.0, f"learner {li}", fontsize=7.5, va="center")
        right = _stack(
            ax, x0 + 6, y, 2.0, [gids[i] for i in flat], [tokens[i] for i in flat], scale
        )
        total = sum(tokens[i] for i in flat)
        ax.text(right + 0.5, y + 1.0, f"{total} tokens", fontsize=7, va="center")
    _note(
        ax,
        x0,
        top - 20.5,
        "groups by tokens, never split;\nfewer groups than learners is refused",
    )

    # 4. each share into micro-batches under the budget
    x0 = 90
    _header(ax, x0, top + 0.6, f"micro-batches: M = {count} on every learner")
    mscale = 18 / max(BUDGET, max(tokens))
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
    _note(
        ax,
        x0,
        ybot - 3.2,
        "the same count everywhere, none empty;\na group over the budget rides alone",
    )

    for xa, xb in ((27.9, 29.4), (51.6, 53.6), (86.4, 89.6)):
        ax.add_patch(
            FancyArrowPatch((xa, top - 8), (xb, top - 8), arrowstyle="-|>", mutation_scale=12)
        )

    # 5. deliver: the sections each holder sends each learner, sized from the table
    wire = Wire(SPEC)
    n, t = _sections(holder, members, tokens, shares)
    _header(ax, 0.6, 20.6, "5. deliver: one exchange")
    cx, cy, cw, chh = 6.5, 16.2, 6.6, 2.5
    for li in range(LEARNERS):
        ax.text(cx + li * cw + cw / 2, cy + 1.3, f"to L{li}", fontsize=7, ha="center")
    for r in range(len(RANKS)):
        y = cy - (r + 1) * chh
        ax.text(0.9, y + chh / 2, f"from rank {r}", fontsize=7, va="center")
        for li in range(LEARNERS):
            cell = Rectangle((cx + li * cw, y), cw, chh, fc="#f4f4f4", ec="#999", lw=0.6)
            ax.add_patch(cell)
            label = f"{n[r, li]} seqs\n{t[r, li]} tok" if n[r, li] else "-"
            ax.text(cx + (li + 0.5) * cw, y + chh / 2, label, fontsize=6, ha="center", va="center")
    nbytes = sum(wire.nbytes(int(n[r, li]), int(t[r, li])) for r in range(3) for li in range(3))
    data = int(n.sum()) * wire.seq_bytes + int(t.sum()) * wire.token_bytes
    _note(
        ax,
        0.9,
        cy - len(RANKS) * chh - 0.6,
        f"sizes from the table: no size message;\n{nbytes} bytes moved for {data} bytes of "
        f"data\n(tokens int32, logprobs fp32, reward; 8-byte\ncolumn alignment is the only "
        "padding). 6. take: the\ndelivered groups leave their holders",
    )

    # the micro-batch with the most sequences, as its learner receives it: packed
    li, k = max(
        ((li, k) for li, s in enumerate(shares) for k in range(len(s))),
        key=lambda lk: (len(shares[lk[0]][lk[1]]), -lk[0]),
    )
    mb = sorted(shares[li][k], key=lambda i: holder[i])  # runs by holder, as `_cut` joins
    seqs = [(gids[i], ln) for i in mb for ln in seqlens[i]]
    sources = sorted({holder[i] for i in mb})
    nseq, width = len(seqs), max(ln for _, ln in seqs)
    total = sum(ln for _, ln in seqs)
    px0, pw = 31.5, 50.0
    _header(ax, px0, 20.6, f"learner {li}, micro-batch {k}: packed, no padding")
    sc = pw / total
    x, cu = px0, [0]
    for gid, ln in seqs:
        ax.add_patch(Rectangle((px0 + cu[-1] * sc, 13.0), ln * sc, 4.0, fc=_color(gid), ec="white"))
        x += ln * sc
        cu.append(cu[-1] + ln)
    for j, c in enumerate(cu):
        xc = px0 + c * sc
        ax.plot([xc, xc], [12.2, 13.0], color="black", lw=0.8)
        ax.text(xc, 11.4 - 1.3 * (j % 2), str(c), fontsize=6.5, ha="center", va="center")
    ax.text(px0, 7.8, f"cu_seqlens (int32, {nseq} sequences + 1)", fontsize=7, color=GREY)
    ax.text(
        px0,
        5.9,
        f'mb["tokens"]: [{total}]   max_seqlen = {width}   mb.tokens = {total}   '
        f"mb.sequences = {nseq}\n"
        f"sequence i is packed[cu_seqlens[i]:cu_seqlens[i + 1]] (varlen attention's input);\n"
        f"from rank{'s' if len(sources) > 1 else ''} {', '.join(map(str, sources))}; "
        f"a group's {G} sequences are consecutive",
        fontsize=7,
        va="top",
    )

    # the padded alternative: mb.padded()
    qx0, qw, rh = 86.0, 20.0, 1.9
    padded = nseq * width
    _header(ax, qx0, 20.6, "the same, mb.padded()")
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
        19.6 - nseq * rh / 2,
        f"[{nseq}, {width}]\n= {padded} slots,\n{padded - total} of them\npadding "
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
