"""Which KV rows a rank needs from which other rank, derived from pieces and the mask.

For every (rank, document) the keys its queries can see form a few intervals (the union of
each piece's visible band); whatever part of those intervals another rank holds must be
received. This is the minimal exchange: documents held whole never appear here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from doccp.layout import repeat_interleave
from doccp.masks import Mask
from doccp.plan.pieces import Pieces


@dataclass(frozen=True)
class Intervals:
    """Rows ``(dst, src, doc, start, end)``: ``dst`` needs keys ``[start, end)`` of ``doc``
    that ``src`` holds. Sorted by (dst, src, doc, start)."""

    dst: torch.Tensor
    src: torch.Tensor
    doc: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor

    @property
    def length(self) -> torch.Tensor:
        return self.end - self.start

    def select(self, keep: torch.Tensor) -> Intervals:
        return Intervals(self.dst[keep], self.src[keep], self.doc[keep], self.start[keep], self.end[keep])

    def tokens_received(self, world_size: int) -> torch.Tensor:
        return torch.zeros(world_size, dtype=torch.int64).index_add_(0, self.dst, self.length)


def visible_intervals(pieces: Pieces, lengths: torch.Tensor, mask: Mask) -> Pieces:
    """Merged key intervals each (rank, doc) can see, as Pieces (rank, doc, lo, hi)."""
    lo, hi = mask.visible_keys(pieces.start, pieces.end, lengths[pieces.doc])
    return Pieces(pieces.rank, pieces.doc, lo, hi).normalized_union()


def kv_exchange(pieces: Pieces, lengths: torch.Tensor, mask: Mask) -> Intervals:
    """The minimal KV exchange of a plan (see module docstring). Vectorised."""
    holders = pieces.select(_split_docs(pieces, lengths.numel())[pieces.doc])
    if len(holders) == 0:
        z = torch.zeros(0, dtype=torch.int64)
        return Intervals(z, z, z, z, z)
    # Holders of each document, ordered by (doc, start): they tile the document.
    big = int(lengths.max()) + 1
    order = torch.argsort(holders.doc * big + holders.start)
    h = holders.select(order)
    key = h.doc * big + h.start
    seen = visible_intervals(holders, lengths, mask)
    # Holder pieces overlapping each visible interval form a contiguous run in `h`.
    first = torch.searchsorted(key, seen.doc * big + seen.start, right=True) - 1
    last = torch.searchsorted(key, seen.doc * big + seen.end, right=False)
    count = (last - first).clamp(min=0)
    total = int(count.sum())
    vi = repeat_interleave(torch.arange(len(seen)), count, total)
    hi_idx = first[vi] + (torch.arange(total) - (torch.cumsum(count, 0) - count)[vi])
    start = torch.maximum(seen.start[vi], h.start[hi_idx])
    end = torch.minimum(seen.end[vi], h.end[hi_idx])
    out = Intervals(seen.rank[vi], h.rank[hi_idx], seen.doc[vi], start, end)
    out = out.select((out.end > out.start) & (out.dst != out.src))
    ranks = int(pieces.rank.max()) + 1
    sort_key = ((out.dst * ranks + out.src) * lengths.numel() + out.doc) * big + out.start
    return out.select(torch.argsort(sort_key))


def _split_docs(pieces: Pieces, num_docs: int) -> torch.Tensor:
    """Boolean per document: held by more than one rank."""
    lo = torch.full((num_docs,), 1 << 30, dtype=torch.int64).scatter_reduce(0, pieces.doc, pieces.rank, "amin")
    hi = torch.full((num_docs,), -1, dtype=torch.int64).scatter_reduce(0, pieces.doc, pieces.rank, "amax")
    return (hi > lo) & (hi >= 0)
