"""Which KV rows a rank needs from which other rank, derived from pieces and the mask.

For every (rank, document) the keys its queries can see form a few intervals (the union of
each piece's visible band); whatever part of those intervals another rank holds must be
received. This is the minimal exchange: documents held whole never appear here.

Everything is interval arithmetic on *global* stream offsets (``cu_seqlens[doc] + pos``):
a plan's pieces in stream order tile the stream, so the holders of any key interval are one
contiguous run of that table, found by binary search (:func:`overlaps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan.pieces import Pieces
from doccp.ranges import expand, index_of, repeat, stable_order, starts, take


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
        index = index_of(keep)
        return self if index is None else Intervals(
            *(take(c, index) for c in (self.dst, self.src, self.doc, self.start, self.end)))

    def tokens_received(self, world_size: int) -> torch.Tensor:
        return torch.zeros(world_size, dtype=torch.int64).index_add_(0, self.dst, self.length)


def visible_intervals(pieces: Pieces, lengths: torch.Tensor, mask: Mask, order: torch.Tensor | None = None
                      ) -> Pieces:
    """Merged key intervals each (rank, doc) can see, as Pieces (rank, doc, lo, hi).

    ``pieces`` must be ordered by (rank, doc, start), or ``order`` must be the permutation that
    orders them so (one rank's pieces in stream order qualify as they are): a band's visible
    range grows with the piece, so the union of one (rank, doc) group is a merge of neighbours,
    no sort. Where every range starts at key 0 (causal and full masks; the mask is a monotone
    interval mask, so the last query tells), they all overlap and a group's union is ``[0, hi)``
    of its last piece: one filter for the groups' last pieces, and only those are gathered in
    order (the plan's hot path)."""
    if not sees_from_key_zero(mask, int(pieces.start.max()) if len(pieces) else 0):
        p = pieces.select(order) if order is not None else pieces
        lo, hi = mask.visible_keys(p.start, p.end, take(lengths, p.doc))
        return Pieces(p.rank, p.doc, lo, hi).normalized_union()
    index = group_ends(pieces, order)
    rank, doc = take(pieces.rank, index), take(pieces.doc, index)
    hi = mask.visible_keys(take(pieces.start, index), take(pieces.end, index), take(lengths, doc))[1]
    seen = Pieces(rank, doc, torch.zeros_like(hi), hi)
    return seen.select(hi > 0)  # empty pieces see nothing


def sees_from_key_zero(mask: Mask, last_query: int) -> bool:
    """Whether every query up to ``last_query`` sees its document from key 0 (causal and full
    masks; the mask is a monotone interval mask, so the last query tells)."""
    return int(mask.visible_keys(last_query, last_query + 1, last_query + 1)[0]) == 0


def group_ends(pieces: Pieces, order: torch.Tensor | None = None) -> torch.Tensor:
    """Indices into ``pieces`` of every (rank, doc) group's last piece, in (rank, doc) order;
    ``pieces`` ordered by (rank, doc, start), or ``order`` the permutation that orders them. A
    group ends where the document changes or at a rank's last piece (ranks ascend in this order:
    their ends are one bincount away, no gather of the rank column)."""
    doc = take(pieces.doc, order)
    last = torch.ones(len(pieces), dtype=torch.bool)
    torch.ne(doc[1:], doc[:-1], out=last[:-1])
    last.index_fill_(0, torch.cumsum(torch.bincount(pieces.rank), 0) - 1, True)
    index = torch.nonzero(last).squeeze(1)
    return take(order, index) if order is not None else index


def prefix_receivers(stream: Pieces, last: torch.Tensor, mine: torch.Tensor, me: int, world_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Who receives rank ``me``'s pieces where a rank sees a document's keys from key 0 to the end
    of its last piece there (a causal mask): ``(i, dst)`` pairs, ``i`` into ``mine`` (``me``'s
    pieces as ascending stream indices), ordered by (dst, i). A piece goes whole to every other
    rank whose last piece of the document lies later in the stream (``last``: ascending stream
    indices of every (rank, doc) group's last piece), each rank once. O(my pieces log + pairs),
    where intersecting every rank's visible keys with my pieces is O(plan) (:func:`document_overlaps`,
    every other mask)."""
    doc_end = torch.searchsorted(stream.doc, take(stream.doc, mine), right=True)  # past the document's pieces
    first = torch.searchsorted(last, mine, right=True)
    count = torch.searchsorted(last, doc_end) - first
    total = int(count.sum())
    i = repeat(torch.arange(mine.numel()), count, total)
    dst = take(stream.rank, take(last, expand(first, count)))
    order = stable_order(dst, world_size)
    i, dst = take(i, order), take(dst, order)
    a, b = torch.searchsorted(dst, torch.tensor([me, me + 1])).tolist()  # my own later pieces: one run
    return (i, dst) if a == b else (torch.cat([i[:a], i[b:]]), torch.cat([dst[:a], dst[b:]]))


def overlaps(lo: torch.Tensor, hi: torch.Tensor, table_lo: torch.Tensor, table_hi: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every overlap of intervals ``[lo, hi)`` with the sorted, disjoint, non-empty intervals of a
    table: ``(i, j, start, end)`` rows, ordered by ``i`` then ``j``. O((queries + rows) log table).

    A query's rows are one run of the table and only the run's first and last row can stick out
    of the query, so only those are clipped (a gather per run, not per row) and no row is empty."""
    first = torch.searchsorted(table_hi, lo, right=True)
    count = torch.where(hi > lo, torch.searchsorted(table_lo, hi, right=False) - first, 0).clamp(min=0)
    total = int(count.sum())
    i = repeat(torch.arange(lo.numel()), count, total)
    j = expand(first, count)
    start, end = take(table_lo, j), take(table_hi, j)
    runs = torch.nonzero(count).squeeze(1)
    head = take(starts(count), runs)  # each run's first row
    tail = head + take(count, runs) - 1
    start.scatter_(0, head, torch.maximum(take(start, head), take(lo, runs)))
    end.scatter_(0, tail, torch.minimum(take(end, tail), take(hi, runs)))
    return i, j, start, end


def document_overlaps(doc: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, table: Pieces, num_docs: int,
                      skip: slice | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`overlaps` for a table with few pieces per document (one rank's pieces, in stream
    order), queries ``[lo, hi)`` of document ``doc``: each query's candidates are its document's
    pieces, found by a gather from a per-document table rather than binary searches (many queries
    in no useful order, e.g. every other rank's visible keys, make searches the cost). Queries in
    ``skip`` get no rows (cheaper than cutting them out of the columns)."""
    count_of = torch.bincount(table.doc, minlength=num_docs)
    first_of = starts(count_of)
    count = take(count_of, doc)
    if skip is not None:
        count[skip] = 0
    return _clipped(lo, hi, table.start, table.end, take(first_of, doc), count)


def _clipped(lo: torch.Tensor, hi: torch.Tensor, table_lo: torch.Tensor, table_hi: torch.Tensor, first: torch.Tensor,
             count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query ``i`` against table rows ``first[i] .. first[i] + count[i] - 1``: the non-empty
    intersections as ``(i, j, start, end)``."""
    total = int(count.sum())
    i = repeat(torch.arange(lo.numel()), count, total)
    j = expand(first, count)
    start = torch.maximum(take(lo, i), take(table_lo, j))
    end = torch.minimum(take(hi, i), take(table_hi, j))
    index = index_of(end > start)
    return take(i, index), take(j, index), take(start, index), take(end, index)


def kv_exchange(stream: Pieces, seen: Pieces, layout: DocLayout) -> Intervals:
    """The minimal KV exchange of a plan (see module docstring): every rank's visible keys
    intersected with the stream's pieces. ``stream``: the plan's pieces in stream order;
    ``seen``: :func:`visible_intervals` of the plan in rank order."""
    cu = layout.cu_seqlens
    base, stream_base = take(cu, seen.doc), take(cu, stream.doc)
    i, j, start, end = overlaps(base + seen.start, base + seen.end, stream_base + stream.start,
                                stream_base + stream.end)
    base = take(base, i)
    out = Intervals(take(seen.rank, i), take(stream.rank, j), take(seen.doc, i), start - base, end - base)
    out = out.select(out.dst != out.src)
    ranks = int(torch.cat([stream.rank, torch.zeros(1, dtype=torch.int64)]).max()) + 1
    # Rows are ordered by (dst, doc, start); a stable sort by (dst, src) finishes the order.
    return out.select(stable_order(out.dst * ranks + out.src, ranks * ranks))
