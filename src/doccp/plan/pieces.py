"""Pieces: ``(rank, doc, start, end)`` rows, the currency every strategy deals in.

A piece is the token range ``[start, end)`` of document ``doc`` (document-relative), held by
``rank``. Pieces are stored column-wise as int64 tensors so that strategies and everything
derived from them (indices, positions, exchange) stay vectorised host work.

A plan's pieces partition the stream, so they can be read in two orders: *stream order*
(by document, then start: the pieces tile the stream, and a token's owner is one binary
search away) and *rank order* (by rank, then document and start: what each rank holds).
Strategies emit either; :meth:`Pieces.stream_normalized` brings them to stream order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from doccp.ranges import all_true, any_true, index_of, take


@dataclass(frozen=True)
class Pieces:
    rank: torch.Tensor
    doc: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor

    @classmethod
    def cat(cls, parts: list[Pieces]) -> Pieces:
        parts = [p for p in parts if p.rank.numel()]
        if not parts:
            return cls.empty()
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("rank", "doc", "start", "end")))

    @classmethod
    def empty(cls) -> Pieces:
        z = torch.zeros(0, dtype=torch.int64)
        return cls(z, z, z, z)

    @classmethod
    def of(cls, rank, doc, start, end) -> Pieces:
        cols = [torch.as_tensor(x, dtype=torch.int64).reshape(-1) for x in (rank, doc, start, end)]
        n = 0 if any(c.numel() == 0 for c in cols) else max(c.numel() for c in cols)
        return cls(*(c.expand(n).clone() if c.numel() == 1 else c for c in cols))

    @property
    def length(self) -> torch.Tensor:
        return self.end - self.start

    def __len__(self) -> int:
        return self.rank.numel()

    def select(self, keep: torch.Tensor | slice) -> Pieces:
        index = index_of(keep)
        return self if index is None else Pieces(*(take(c, index) for c in (self.rank, self.doc, self.start, self.end)))

    def normalized(self) -> Pieces:
        """Drop empty pieces, order by (rank, doc, start) and merge touching neighbours."""
        return self._merged(by_rank=True, overlapping=False)

    def normalized_union(self) -> Pieces:
        """Like :meth:`normalized`, but ranges may overlap: merge them into their union."""
        return self._merged(by_rank=True, overlapping=True)

    def stream_normalized(self) -> Pieces:
        """Drop empty pieces, order by (doc, start) and merge touching neighbours of one rank.
        For the pieces of a plan (a partition of the stream) this is stream order."""
        return self._merged(by_rank=False, overlapping=False)

    def _merged(self, by_rank: bool, overlapping: bool) -> Pieces:
        p = self.select(self.end > self.start)
        if len(p) == 0:
            return p
        big = int(p.end.max()) + 1
        docs = int(p.doc.max()) + 1
        group_key = p.rank * docs + p.doc if by_rank else p.doc
        key = group_key * big + p.start
        if not all_true(key[1:] >= key[:-1]):  # strategies usually emit pieces in order already
            order = torch.argsort(key)
            p, group_key = p.select(order), take(group_key, order)
        # A run's end: with overlaps, the running max of `end` within its group at the run's last
        # range (earlier runs of the group end before the run starts); else its last piece's end.
        reach = torch.cummax(group_key * big + p.end, 0).values - group_key * big if overlapping else p.end
        touches = p.start[1:] <= reach[:-1] if overlapping else p.start[1:] == p.end[:-1]
        same = (group_key[1:] == group_key[:-1]) & touches
        if not by_rank:
            same &= p.rank[1:] == p.rank[:-1]
        if not any_true(same):
            return p
        first = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), ~same])).squeeze(1)
        last = torch.nonzero(torch.cat([~same, torch.ones(1, dtype=torch.bool)])).squeeze(1)
        q = p.select(first)
        return Pieces(q.rank, q.doc, q.start, take(reach, last))


def cut_stream(cu_seqlens: torch.Tensor, sizes: torch.Tensor) -> Pieces:
    """Cut a packed stream into consecutive ranges of ``sizes[r]`` tokens, range r to rank r.

    The pieces are the intersections of those ranges with the documents, in stream order;
    this is the ``contiguous`` strategy.
    """
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    cuts = torch.unique(torch.cat([cu_seqlens, bounds]))
    seg_start, seg_end = cuts[:-1], cuts[1:]
    doc = torch.searchsorted(cu_seqlens, seg_start, right=True) - 1
    rank = torch.searchsorted(bounds, seg_start, right=True) - 1
    keep = (seg_end > seg_start) & (doc < cu_seqlens.numel() - 1) & (rank < sizes.numel())
    index = index_of(keep)
    doc, rank, seg_start, seg_end = (take(x, index) for x in (doc, rank, seg_start, seg_end))
    base = take(cu_seqlens, doc)
    return Pieces(rank, doc, seg_start - base, seg_end - base)


def even_sizes(total: int, parts: int) -> torch.Tensor:
    """``total`` split into ``parts`` sizes differing by at most one (larger ones first)."""
    return torch.full((parts,), total // parts, dtype=torch.int64) + (
        torch.arange(parts) < total % parts).long()
