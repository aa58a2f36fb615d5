"""Pictures of a plan: the document mask coloured by rank, and the work per rank.

The left panel is the ``T x T`` attention matrix of the packed stream: a cell ``(q, k)`` is
coloured by the rank that holds query ``q`` when ``q`` sees ``k`` (same document, inside the
mask), white otherwise. Balanced plans show every colour spread along the diagonal blocks;
``contiguous`` shows horizontal bands. Large streams are drawn at ``size`` pixels: each row
samples the query at the middle of its band, each column is visible if any of its keys is.

matplotlib is imported on first use (``pip install 'doccp[plot]'``); nothing else needs it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from doccp.plan import Plan

#: Colour of cells that no query sees.
BACKGROUND = (1.0, 1.0, 1.0)


def owners(plan: Plan, tokens: torch.Tensor) -> torch.Tensor:
    """The rank holding each of ``tokens`` (stream indices): a binary search over the pieces,
    so pictures of huge streams cost O(pieces + samples), never O(tokens)."""
    p = plan.all_pieces
    first = plan.layout.cu_seqlens[p.doc] + p.start
    order = torch.argsort(first)
    piece = torch.searchsorted(first[order], tokens, right=True) - 1
    return p.rank[order][piece]


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
    """Write a PNG of ``plan``: the mask coloured by rank, and a bar chart of work per rank."""
    try:
        import numpy as np
        from matplotlib import colormaps
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"doccp.app.plot needs matplotlib ({e}); install it with pip install 'doccp[plot]'") from None

    n = plan.world_size
    palette = colormaps["tab10" if n <= 10 else "tab20"]
    colors = np.array([palette(r % palette.N)[:3] for r in range(n)] + [BACKGROUND])
    image = colors[mask_image(plan, size).numpy()]  # -1 picks the background (last row)
    stats = plan.stats()
    layout = plan.layout

    fig = Figure(figsize=(12, 5.6), layout="constrained")
    ax_mask, ax_work = fig.subplots(1, 2, width_ratios=[1.15, 1])
    t = layout.num_tokens
    ax_mask.imshow(image if t else np.ones((1, 1, 3)), extent=(0, max(t, 1), max(t, 1), 0),
                   interpolation="nearest")
    ax_mask.set(title=f"mask {plan.mask}, query rows coloured by rank", xlabel="key token", ylabel="query token")
    if layout.num_docs <= 24:  # document boundaries, when they stay readable
        for edge in layout.cu_seqlens[1:-1].tolist():
            ax_mask.axhline(edge, color="0.85", lw=0.4)
            ax_mask.axvline(edge, color="0.85", lw=0.4)

    ranks = list(range(n))
    mean = stats.total_work / n
    ax_work.bar(ranks, stats.work, color=colors[:n])
    ax_work.axhline(mean, color="black", lw=1, ls="--", label=f"mean {mean:,.0f}")
    ax_work.set(title=f"work per rank (max/mean {stats.imbalance:.3f})", xlabel="rank",
                ylabel="visible (q, k) pairs")
    ax_work.set_xticks(ranks if n <= 32 else ranks[:: max(1, n // 16)])
    handles = [Patch(color=colors[r], label=f"rank {r}: {stats.tokens[r]} tok, {stats.pieces[r]} pieces, "
                     f"KV in {stats.kv_recv[r]}") for r in ranks[:16]]
    ax_work.set_ylim(0, max(max(stats.work), 1) * (1.2 + 0.05 * len(handles)))  # room for the legend
    ax_work.legend(handles=[*handles, *ax_work.get_legend_handles_labels()[0]], fontsize=7, loc="upper center",
                   ncol=2)
    fig.suptitle(f"doccp plan: {plan.strategy}, {n} ranks, {layout.num_docs} documents, {t} tokens, "
                 f"max KV received {stats.max_kv_fraction:.1%} of an all-gather")
    path = Path(path)
    fig.savefig(path, dpi=100, format="png")
    return path
