"""``balanced``: equal tokens and work per rank, little KV to exchange, short documents whole.

Every rank must end with the same number of tokens (within one) *and* the same attention
work (mask pairs, max/mean <= 1.01). A rank receives KV only for documents it holds part of,
and for a causal mask a piece ``[a, b)`` needs exactly its prefix ``[0, a)``; so the plan cuts
few documents, into contiguous runs whose later parts start early::

    1. cut     docs too big for one rank (tokens or work)  ->  contiguous parts, cut from the
               end so the late (expensive, KV-hungry) parts are as long as a rank allows
    2. pack    whole docs and parts, largest work first     ->  onto the least-loaded rank
               with token room (LPT)
    3. chain   order the ranks so their token surpluses cancel, lay their items out in that
               order (small documents at both ends of each rank's run) and cut the result
               into exact token counts: a rank over by k tokens hands its neighbour the
               first k tokens of its last small document, and that neighbour receives k

    ranks after packing (tokens, target 10):  r0 = 12   r1 = 7    r2 = 11
    chain r0 r1 r2, cut at 10 and 20:        |a a a a a a a a a b|b b b b b b c c c c|c c c c c c c c c c|
    r0 hands 2 tokens of its last doc to r1 (r1 receives 1 KV row), r1 takes 1 of r2's first doc.

Several split thresholds are tried (a document is cut when it needs more than that share of a
rank); the plan with balanced work (max/mean <= 1.01) that receives the least KV wins, ties
to fewer pieces. Layouts no threshold can balance (one document much longer than a rank)
fall back to :mod:`doccp.plan.absorb`, which fixes every rank's work exactly.
"""

from __future__ import annotations

import heapq

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan.absorb import absorb
from doccp.plan.exchange import visible_intervals
from doccp.plan.pieces import Pieces, cut_stream, even_sizes

#: Split thresholds tried, as a share of one rank's tokens and work.
SHARES = (1.0,)
#: Work imbalance (max/mean) a plan must reach.
TOLERANCE = 1.01


def balanced(layout: DocLayout, world_size: int, mask: Mask) -> Pieces:
    n, lengths = world_size, layout.lengths
    if n == 1 or layout.num_tokens == 0:
        return Pieces.of(0, torch.arange(layout.num_docs), 0, lengths)
    work = mask.pairs(0, lengths, 0, lengths)
    candidates = [_chained(layout, n, mask, work, share) for share in SHARES]
    scores = [_score(p, layout, n, mask) for p in candidates]
    if all(unbalanced for unbalanced, *_ in scores):  # no threshold balanced the work
        candidates.append(absorb(layout, n, mask, work))
        scores.append(_score(candidates[-1], layout, n, mask))
    return candidates[min(range(len(scores)), key=scores.__getitem__)]


def _score(pieces: Pieces, layout: DocLayout, n: int, mask: Mask) -> tuple[bool, int, int]:
    """(unbalanced, max KV received, pieces): what the planner minimises, in that order."""
    p = pieces.normalized()
    lengths = layout.lengths
    work = torch.zeros(n, dtype=torch.float64).index_add_(
        0, p.rank, mask.pairs(p.start, p.end, 0, lengths[p.doc]).double())
    seen = visible_intervals(p, lengths, mask)
    kv = torch.zeros(n, dtype=torch.int64).index_add_(0, seen.rank, seen.length).index_add_(0, p.rank, -p.length)
    unbalanced = float(work.max()) > TOLERANCE * float(work.mean())
    return unbalanced, int(kv.max()), len(p)


def _chained(layout: DocLayout, n: int, mask: Mask, work: torch.Tensor, share: float) -> Pieces:
    lengths = layout.lengths
    targets = even_sizes(layout.num_tokens, n)
    mean_tokens, mean_work = layout.num_tokens / n, float(work.sum()) / n
    split = (lengths > share * mean_tokens) | (work.double() > share * mean_work)
    docs = torch.arange(lengths.numel())
    parts = _cut_parts(docs[split], lengths[split], mask, max(int(share * mean_tokens), 1), share * mean_work)
    whole = docs[~split & (lengths > 0)]
    items = Pieces.cat([Pieces.of(-1, whole, 0, lengths[whole]), parts])
    item_work = mask.pairs(items.start, items.end, 0, lengths[items.doc])
    rank = _pack(items.length.tolist(), item_work.tolist(), int(targets[-1]), n)
    return _cut_chain(items, rank, targets, n)


def _cut_parts(docs: torch.Tensor, lengths: torch.Tensor, mask: Mask, max_tokens: int,
               max_work: float) -> Pieces:
    """Cut each document into contiguous parts from its end: every part as long as it can be
    with at most ``max_tokens`` tokens and ``max_work`` pairs (at least one token), so the
    late parts, whose holders receive the longest prefixes, start as early as possible."""
    parts = []
    end = lengths.clone()
    while docs.numel():
        lo = (end - max_tokens).clamp(min=0)  # the longest part allowed by tokens ...
        hi = end - 1  # ... and the shortest: one token
        # binary search: the smallest start in [lo, hi] whose part fits the work budget
        while True:
            open_ = lo < hi
            if not bool(open_.any()):
                break
            mid = (lo + hi) // 2
            fits = mask.pairs(mid, end, 0, lengths).double() <= max_work
            hi = torch.where(open_ & fits, mid, hi)
            lo = torch.where(open_ & ~fits, mid + 1, lo)
        parts.append(Pieces.of(-1, docs, lo, end))
        more = lo > 0
        docs, lengths, end = docs[more], lengths[more], lo[more]
    return Pieces.cat(parts)


def _pack(tokens: list[int], work: list[int], room: int, n: int) -> list[int]:
    """Largest work first, each item onto the least-loaded rank with token room for it (a
    heap of ranks by work: O(items log N)); an item no rank has room for goes to the rank
    with the most room. Returns the rank of every item."""
    order = sorted(range(len(tokens)), key=lambda i: (-work[i], -tokens[i]))
    free, load = [room] * n, [0] * n
    heap = [(0, r) for r in range(n)]  # ranks with room left, by work
    rank = [0] * len(tokens)
    for i in order:
        skipped = []
        while heap and free[heap[0][1]] < tokens[i]:
            skipped.append(heapq.heappop(heap))
        if heap:
            r = heapq.heappop(heap)[1]
        else:
            r = max(range(n), key=free.__getitem__)
            skipped = [entry for entry in skipped if entry[1] != r]
        rank[i] = r
        free[r] -= tokens[i]
        load[r] += work[i]
        if free[r] > 0:
            heapq.heappush(heap, (load[r], r))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return rank


def _cut_chain(items: Pieces, rank: list[int], targets: torch.Tensor, n: int) -> Pieces:
    """Lay every rank's items out one rank after another (ranks ordered so that token
    surpluses cancel, each rank's items small-large-small) and cut that sequence into the
    exact token targets; an item crossing a cut is split between the two neighbours."""
    rank_t = torch.tensor(rank, dtype=torch.int64)
    tokens = torch.zeros(n, dtype=torch.int64).index_add_(0, rank_t, items.length)
    chain = _chain_order((tokens - targets[-1]).tolist())
    position = torch.empty(n, dtype=torch.int64)
    position[torch.tensor(chain)] = torch.arange(n)
    # Within a rank: ascending length, alternately to the front and the back.
    length = items.length
    by_size = torch.argsort(position[rank_t] * (int(length.max()) + 1) + length, stable=True)
    group = position[rank_t][by_size]
    start_of_group = torch.searchsorted(group, group, right=False)
    k = torch.arange(group.numel()) - start_of_group  # index within the rank, by size
    count = torch.bincount(group, minlength=n)[group]
    slot = torch.where(k % 2 == 0, k // 2, count - 1 - k // 2)
    order = by_size[torch.argsort(group * group.numel() + slot)]
    laid = items.select(order)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(laid.length, 0)])
    cut = cut_stream(cu, targets)  # targets[0] >= targets[-1]: the extra tokens go first
    item = laid.select(cut.doc)
    return Pieces(torch.tensor(chain)[cut.rank], item.doc, item.start + cut.start, item.start + cut.end)


def _chain_order(surplus: list[int]) -> list[int]:
    """Ranks in an order whose running token surplus stays near zero: take the largest
    surplus while the running sum is <= 0, the largest deficit while it is > 0."""
    ranked = sorted(range(len(surplus)), key=lambda r: surplus[r])
    lo, hi, running, chain = 0, len(ranked) - 1, 0, []
    while lo <= hi:
        if running > 0:
            r, lo = ranked[lo], lo + 1
        else:
            r, hi = ranked[hi], hi - 1
        chain.append(r)
        running += surplus[r]
    return chain
