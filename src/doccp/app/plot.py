"""Pictures of a plan: the document mask coloured by rank, who holds each document, and the
work per rank.

The left panel is the ``T x T`` attention matrix of the packed stream: a cell ``(q, k)`` is
coloured by the rank that holds query ``q`` when ``q`` sees ``k`` (same document, inside the
mask), white otherwise. Balanced plans show every colour spread along the diagonal blocks;
``contiguous`` shows horizontal bands. Large streams are drawn at ``size`` pixels: each row
samples the query at the middle of its band, each column is visible if any of its keys is;
documents too short to show at that scale get a marker on the diagonal.

The top right panel zooms in on the first documents, one row each, stretched to the full
width: which rank holds which part of each document, readable however long the stream is.

matplotlib is imported on first use (``pip install 'doccp[plot]'``); nothing else needs it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from doccp.plan import Plan

#: Colour of cells that no query sees.
BACKGROUND = (1.0, 1.0, 1.0)
#: Documents in the zoom panel (and the ``doccp plan`` text picture), cells per document there.
ZOOM_DOCS, ZOOM_WIDTH = 24, 256
#: Ranks named in the legends; more are drawn but not listed.
LEGEND_RANKS = 16


def owners(plan: Plan, tokens: torch.Tensor) -> torch.Tensor:
    """The rank holding each of ``tokens`` (stream indices): a binary search over the pieces,
    so pictures of huge streams cost O(pieces + samples), never O(tokens)."""
    p = plan.all_pieces
    first = plan.layout.cu_seqlens[p.doc] + p.start
    order = torch.argsort(first)
    piece = torch.searchsorted(first[order], tokens, right=True) - 1
    return p.rank[order][piece]


def document_owners(plan: Plan, docs: int, width: int) -> list[torch.Tensor]:
    """For each of the first ``docs`` documents, the rank holding each of ``min(length,
    width)`` evenly spaced tokens (each the middle token of its band)."""
    cu = plan.layout.cu_seqlens.tolist()
    rows = []
    for doc in range(min(plan.layout.num_docs, docs)):
        start, length = cu[doc], cu[doc + 1] - cu[doc]
        cells = min(length, width)
        sampled = [start + (2 * c + 1) * length // (2 * cells) for c in range(cells)]
        rows.append(owners(plan, torch.tensor(sampled, dtype=torch.int64)))
    return rows


def mask_image(plan: Plan, size: int = 768) -> torch.Tensor:
    """``[B, B]`` int64 picture of the mask, ``B = min(T, size)``: the rank holding each row's
    query where it sees the column's keys, ``-1`` elsewhere."""
    layout = plan.layout
    t = layout.num_tokens
    b = min(t, size)
    if b == 0:
        return torch.full((0, 0), -1, dtype=torch.int64)
    edges = torch.div(torch.arange(b + 1) * t, b, rounding_mode="floor")
    q = (edges[:-1] + edges[1:] - 1) // 2  # the middle query of each row band
    doc = torch.searchsorted(layout.cu_seqlens, q, right=True) - 1
    start = layout.cu_seqlens[doc]
    pos = q - start
    lo, hi = plan.mask.visible_keys(pos, pos + 1, layout.lengths[doc])
    seen = (edges[None, :-1] < (start + hi)[:, None]) & (edges[None, 1:] > (start + lo)[:, None])
    return torch.where(seen, owners(plan, q)[:, None], -1)


def plot_plan(plan: Plan, path: str | Path, size: int = 768) -> Path:
    """Write a PNG of ``plan`` (see :func:`plan_figure`)."""
    path = Path(path)
    plan_figure(plan, size).savefig(path, dpi=100, format="png")
    return path


def tiny_documents(plan: Plan, size: int = 768) -> list[int]:
    """Non-empty documents under 3 pixels tall in a ``size``-pixel picture of the mask."""
    t = plan.layout.num_tokens
    lengths = plan.layout.lengths.tolist()
    return [d for d, n in enumerate(lengths) if 0 < n < 3 * t / max(min(t, size), 1)]


def plan_figure(plan: Plan, size: int = 768):
    """A matplotlib figure of ``plan``: the mask coloured by rank, the first documents one row
    each, and a bar chart of work per rank with each rank's tokens, pieces and KV received."""
    try:
        import numpy as np
        from matplotlib import colormaps
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"doccp.app.plot needs matplotlib ({e}); install it with pip install 'doccp[plot]'") from None

    n = plan.world_size
    palette = colormaps["tab10" if n <= 10 else "tab20"]
    colors = np.array([palette(r % palette.N)[:3] for r in range(n)] + [BACKGROUND])
    stats = plan.stats()
    layout = plan.layout
    t = layout.num_tokens

    fig = Figure(figsize=(13, 6.4), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=[1.1, 1], height_ratios=[1, 1])
    ax_mask, ax_docs, ax_work = fig.add_subplot(grid[:, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, 1])

    # -- the mask, coloured by the rank holding each query row ---------------------------------
    image = colors[mask_image(plan, size).numpy()] if t else np.ones((1, 1, 3))  # -1: background
    ax_mask.imshow(image, extent=(0, max(t, 1), max(t, 1), 0), interpolation="nearest")
    ax_mask.set(title=f"mask {plan.mask}: cell (query, key) in the colour of the query's rank",
                xlabel="key token", ylabel="query token")
    ax_mask.title.set_fontsize(10)
    cu = layout.cu_seqlens.tolist()
    if layout.num_docs <= 24:  # document boundaries, when they stay readable
        for edge in cu[1:-1]:
            ax_mask.axhline(edge, color="0.85", lw=0.4)
            ax_mask.axvline(edge, color="0.85", lw=0.4)
    tiny = tiny_documents(plan, size)
    if tiny:  # under 3 pixels: a marker in the colour of the rank holding the document's middle
        middle = torch.tensor([(cu[d] + cu[d + 1] - 1) // 2 for d in tiny])
        ax_mask.scatter(middle + 0.5, middle + 0.5, s=14, marker="D", c=colors[owners(plan, middle).numpy()],
                        edgecolors="black", linewidths=0.4, zorder=3)
    legend = [Patch(facecolor=colors[r], label=f"rank {r}") for r in range(min(n, LEGEND_RANKS))]
    legend.append(Patch(facecolor=BACKGROUND, edgecolor="0.6", label="not visible"))
    if tiny:
        legend.append(Line2D([], [], ls="", marker="D", markersize=4, color="0.5", markeredgecolor="black",
                             label=f"document under 3 px ({len(tiny)})"))
    ax_mask.legend(handles=legend, loc="upper right", fontsize=7, title="query rows held by",
                   title_fontsize=7, framealpha=0.9)

    # -- the first documents, one row each, stretched to the full width ------------------------
    rows = document_owners(plan, ZOOM_DOCS, ZOOM_WIDTH)
    zoom = np.ones((max(len(rows), 1), ZOOM_WIDTH, 3))
    for i, row in enumerate(rows):
        if len(row):  # an empty document stays white
            zoom[i] = colors[row.numpy()][np.arange(ZOOM_WIDTH) * len(row) // ZOOM_WIDTH]
    ax_docs.imshow(zoom, aspect="auto", interpolation="nearest", extent=(0, 100, len(rows) or 1, 0))
    ax_docs.set_yticks([i + 0.5 for i in range(len(rows))],
                       [f"doc {i} ({cu[i + 1] - cu[i]} tok)" for i in range(len(rows))],
                       fontsize=7 if len(rows) <= 12 else 6)
    shown = f"the first {len(rows)} of {layout.num_docs}" if layout.num_docs > len(rows) else f"all {len(rows)}"
    ax_docs.set(title=f"who holds each document ({shown}, one row each, full width)",
                xlabel="position in the document (%)")
    ax_docs.title.set_fontsize(10)

    # -- work per rank ---------------------------------------------------------------------------
    ranks = list(range(n))
    mean = stats.total_work / n
    ax_work.bar(ranks, stats.work, color=colors[:n])
    ax_work.axhline(mean, color="black", lw=1, ls="--")
    ax_work.set(title=f"work per rank (dashed: the mean, {mean:,.0f}; max/mean {stats.imbalance:.3f})", xlabel="rank",
                ylabel="visible (q, k) pairs")
    ax_work.title.set_fontsize(10)
    ax_work.set_xticks(ranks if n <= 32 else ranks[:: max(1, n // 16)])
    if n <= LEGEND_RANKS:  # each rank's figures, written on its bar
        ax_work.set_ylim(0, max(max(stats.work), 1) * 1.3)
        for r in ranks:
            ax_work.text(r, 0.02 * max(max(stats.work), 1), f"{stats.tokens[r]} tokens, "
                         f"{_count(stats.pieces[r], 'piece')}, KV received: {stats.kv_recv[r]} tokens", rotation=90,
                         ha="center", va="bottom", fontsize=6.5 if n <= 8 else 5,
                         bbox=dict(facecolor="white", alpha=0.75, lw=0, pad=1))
    fig.suptitle(f"doccp plan: {plan.strategy}, {n} ranks, {layout.num_docs} documents, {t} tokens; a rank "
                 f"receives at most {stats.max_kv_fraction:.1%} of the KV an all-gather would send")
    return fig


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("s" if n != 1 else "")
