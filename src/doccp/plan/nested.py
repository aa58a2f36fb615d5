"""Nested parts of one document too big to stay whole: a candidate of the ``balanced`` planner.

Under a causal mask a rank needs every key of the document below its highest row. So the rank
that holds the document's last row receives everything it does not hold, and its cheapest way to
hold many rows is a few of the expensive last ones and many of the cheap first ones: a *tail*
and a *head*. Whatever lies between is the next rank's problem, one level in, and so on: every
rank holds a head and a tail of what the ranks outside it left, the innermost one the middle::

    one document over 3 ranks: rank 0 holds the head [0, a0) and the tail [b0, L), rank 1 the
    head and tail of the rest, rank 2 the middle
    rows  0 ...... a0 ...... a1 ...... b1 ...... b0 ...... L
    rank      0        1         2         1         0
    rank 0 needs keys [0, L) and receives [a0, b0); rank 1 needs [0, b0) and receives [0, a0) and
    [a1, b1); rank 2 needs [0, b1) and receives [0, a1)

For a bound ``K`` on the keys any rank receives, the ranks are filled from the outside in: each
takes the longest tail its work share allows, with the head the bound then asks for (heads are
the cheapest rows), and the rest of its tokens is filled by other documents at their mean work
per token. The least ``K`` for which the document fits is found on a grid of bounds refined
once, every bound's pass at once (vectorised over the grid; the loop is over the ranks the
document needs, a handful). The ``balanced`` planner pins the parts to their ranks and shares
out the other documents around them, and keeps the plan if it scores best (measured on Pareto
layouts: a document of 57% of the tokens over 4 ranks, 0.522 -> 0.489 of an all-gather). It sizes
the parts for a few fill densities, the mean and lighter ones: the outer ranks, which hold most of
the document, can be filled with the lightest documents, and then hold more of it.

Two such documents that do not fit nested on ranks of their own are nested from opposite ends
instead (:func:`opposed_parts`): the first from rank 0 inwards, the second from rank N - 1, and
the innermost rank of both holds both middles and the other documents. Every other rank holds
parts only, as many rows as its tokens: the longest tail its work allows and a head up to its
tokens (its work is known, not estimated from a fill). The second document's head may go to a
rank of the first instead: a rank that holds a document's first rows and none above them receives
none of it, and first rows cost the least work, so they fill a rank whose tail is costly::

    two documents A and B over 4 ranks: A nested over ranks 0, 1 and the shared rank 2, B over
    ranks 3 and 2, B's head on rank 1
    A rows  0 ..... a0 ..... a1 ......... b1 ..... b0 ..... LA
    rank        0       1         2           1        0
    B rows  0 .. h ..... c0 .......... d0 ..... LB
    rank      1     3          2           3

Measured on the long mix (two documents of 71580 and 59492 tokens): 0.625 -> 0.478 of an
all-gather over 4 ranks (the bound: 0.395), 0.514 -> 0.481 over 8 (the bound itself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from doccp.masks import Mask
from doccp.plan.pieces import Pieces

#: Bounds tried per pass of the search for the least ``K`` (two passes: the grid, then the
#: interval where it turns feasible, so the bound is found to ``L / NESTED_GRID**2``).
NESTED_GRID = 16
#: Tail lengths tried per refinement of a rank's longest tail (for every bound at once).
TAIL_GRID = 64
#: Shares of a rank's tokens the second of two opposed documents may donate of its head to a rank
#: of the first (:func:`opposed_parts`): a head is free of KV for a holder of nothing above it.
DONATED_HEADS = tuple(j / 8 for j in range(1, 8))
#: Tail lengths tried per refinement in :func:`opposed_parts` (it sizes hundreds of layouts at once,
#: and a finer grid costs more per refinement than the refinements it saves).
OPPOSED_GRID = 8
#: Opposed layouts :func:`opposed_parts` returns, the least KV of their own holders first.
OPPOSED_KEEP = 4


def nested_parts(doc: int, length: int, rank_tokens: torch.Tensor, cap: float, fill_densities: Sequence[float],
                 mask: Mask) -> list[Pieces | None]:
    """Parts of document ``doc`` (``length`` tokens) per rank, ranks 0, 1, ... from the outside in
    (see the module docstring), for the least bound the greedy fits (None where none does), one
    entry per fill density: ``fill_densities`` are the work per token assumed of the other
    documents that fill the ranks up, all searched in the same vectorised passes.
    ``rank_tokens``: every rank's tokens, or per density a row of them (ranks of no tokens pad a
    row: none of the document goes there); ``cap``: the most work a rank may do."""
    found: list[Pieces | None] = [None] * len(fill_densities)
    if length <= 0 or not _prefix_mask(mask, length):
        return found
    tokens = rank_tokens.expand(len(fill_densities), -1) if rank_tokens.dim() == 1 else rank_tokens
    search = dict.fromkeys(range(len(fill_densities)), (0, length))  # the bounds still open, per density
    for _ in range(2):  # the grid, then the interval where it turns feasible
        grids = {i: torch.linspace(lo, hi, NESTED_GRID).round().long().unique() for i, (lo, hi) in search.items()}
        rows = torch.cat([torch.full((g.numel(),), i) for i, g in grids.items()])  # each bound's density
        fills = torch.tensor([float(f) for f in fill_densities], dtype=torch.float64)[rows]
        greedy = _Greedy(length, tokens[rows], cap, fills, mask, torch.cat(list(grids.values())))
        search, at = {}, 0
        for i, bounds in grids.items():
            fits = greedy.fits[at:at + bounds.numel()]
            if bool(fits.any()):
                first = int(torch.nonzero(fits)[0])
                found[i] = greedy.parts(at + first, doc)
                lo_k, hi_k = (int(bounds[first - 1]) if first else 0), int(bounds[first])
                if hi_k - lo_k > 1:
                    search[i] = (lo_k, hi_k)
            at += bounds.numel()
        if not search:
            break
    return found


def opposed_parts(docs: tuple[int, int], lengths: tuple[int, int], rank_tokens: torch.Tensor, cap: float,
                  rest_work: float, mask: Mask, keep: int = OPPOSED_KEEP) -> list[Pieces]:
    """Two documents too big to stay whole, nested from opposite ends and sharing a rank (the
    second section of the module docstring): one from rank 0, the other from rank N - 1 (each of
    the two first), both middles on one rank ``m``, which the other documents fill (``rest_work``:
    their work); the second's head maybe on a rank of the first. Every rank but ``m`` is filled by
    its parts exactly, each taking the longest tail its work allows (``cap``) and a head up to its
    tokens. Up to ``keep`` distinct layouts, the least KV of their own holders first (both orders,
    every ``m``, donor rank and share of :data:`DONATED_HEADS` sized in one vectorised pass)."""
    n = rank_tokens.numel()
    if n < 2 or min(lengths) <= 0 or not _prefix_mask(mask, max(lengths)):
        return []
    shares = len(DONATED_HEADS)
    shared = torch.tensor([m for m in range(1, n) for _ in range(1 + m * shares)])
    donor = torch.tensor([d for m in range(1, n) for d in [-1, *(r for r in range(m) for _ in DONATED_HEADS)]])
    share = torch.tensor([0.0, *DONATED_HEADS], dtype=torch.float64)[
        torch.cat([torch.arange(1 + m * shares) for m in range(1, n)]).sub_(1).remainder_(max(shares, 1)).add_(1)
        * (donor >= 0)]
    swapped = torch.arange(2).repeat_interleave(shared.numel())  # 1: the second document from rank 0
    first, second = torch.tensor(lengths)[swapped], torch.tensor(lengths)[1 - swapped]
    kv, ok, (rank, which, start, end) = _opposed(first, second, rank_tokens, cap, rest_work, mask,
                                                 shared.repeat(2), donor.repeat(2), share.repeat(2))
    doc = torch.tensor(docs)[which ^ swapped[:, None]]
    found: dict[bytes, Pieces] = {}
    for i in torch.nonzero(ok).flatten()[torch.argsort(kv[ok], stable=True)].tolist():
        p = Pieces(rank[i], doc[i], start[i], end[i]).select(end[i] > start[i])
        found.setdefault(torch.cat([p.rank, p.doc, p.start]).numpy().tobytes(), p)  # (shares may tie)
        if len(found) == keep:
            break
    return list(found.values())


def _opposed(first: torch.Tensor, second: torch.Tensor, rank_tokens: torch.Tensor, cap: float, rest_work: float,
             mask: Mask, shared: torch.Tensor, donor: torch.Tensor, share: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`opposed_parts` for every layout at once: layout ``i`` nests a document of
    ``first[i]`` tokens from rank 0 and one of ``second[i]`` from rank N - 1, shares rank
    ``shared[i]`` and donates ``share[i]`` of rank ``donor[i]``'s tokens (-1: none). Each layout's
    max KV of its holders, whether it fits, and its parts as (rank, which document: 0 the first,
    start, end) columns, one row per layout (empty parts where a rank holds fewer)."""
    n, c = rank_tokens.numel(), shared.numel()
    kv, ok, columns = torch.zeros(c, dtype=torch.int64), torch.ones(c, dtype=torch.bool), []
    lengths = torch.stack([first, second], 1)

    def work(doc: int, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        return mask.row_work(start, end, lengths[:, doc].view(-1, *[1] * (start.dim() - 1))).double()

    def outer(doc: int, r: int, active: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, room: torch.Tensor,
              limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``r`` (where ``active``) filled by ``room`` rows of the document's rest ``[lo, hi)``:
        the longest tail ``t`` within ``limit`` of work and the head ``room - t`` (the work grows
        with ``t`` while the rest is longer than the room)."""
        nonlocal kv, ok
        room = torch.where(active, room, 1)  # (converges at once)
        lo2, hi2, room2, limit2 = lo[:, None], hi[:, None], room[:, None], limit[:, None]
        t, fits = _longest(lambda t: (t <= room2) & (work(doc, lo2, lo2 + room2 - t) + work(doc, hi2 - t, hi2)
                                                      <= limit2), room, OPPOSED_GRID)
        ok = ok & (~active | (fits & (hi - lo > room)))
        kv = torch.where(active, torch.maximum(kv, hi - room), kv)  # it lacks every row below its tail but its head
        head_end, tail_start = torch.where(active, lo + room - t, lo), torch.where(active, hi - t, hi)
        rank = torch.full((c,), r)
        columns.extend([(rank, doc, lo, head_end), (rank, doc, tail_start, hi)])
        return head_end, tail_start

    lo, hi = torch.zeros(c, dtype=torch.int64), first.clone()
    head = torch.zeros(c, dtype=torch.int64)  # the second document's donated head
    for r in range(n - 1):
        tokens = int(rank_tokens[r])
        h = torch.where(donor == r, torch.minimum((share * tokens).long(), second), 0)
        head += h
        lo, hi = outer(0, r, r < shared, lo, hi, tokens - h, cap - work(1, torch.zeros_like(h), h))
    columns.append((donor.clamp(min=0), 1, torch.zeros_like(head), head))
    lo_b, hi_b = head.clone(), second.clone()
    for r in range(n - 1, 0, -1):
        lo_b, hi_b = outer(1, r, r > shared, lo_b, hi_b, torch.full((c,), int(rank_tokens[r])),
                           torch.full((c,), cap))
    # The shared rank: both middles and the other documents.
    ok = ok & ((hi - lo) + (hi_b - lo_b) <= rank_tokens[shared]) & (
        work(0, lo, hi) + work(1, lo_b, hi_b) + rest_work <= cap)
    kv = torch.maximum(kv, lo + torch.where(hi_b > lo_b, lo_b, 0))
    columns.extend([(shared, 0, lo, hi), (shared, 1, lo_b, hi_b)])
    return kv, ok, tuple(torch.stack([col[k] if torch.is_tensor(col[k]) else torch.full((c,), col[k])
                                      for col in columns], 1) for k in range(4))


def _prefix_mask(mask: Mask, length: int) -> bool:
    """Every row sees its document from key 0 up to itself, never later keys (causal)."""
    return not mask.looks_ahead and int(torch.as_tensor(mask.visible_keys(length - 1, length, length)[0])) == 0


class _Greedy:
    """The outside-in pass of the module docstring for every bound in ``bounds`` at once (each with
    its fill density, ``fills``, and its ranks' tokens, a row of ``rank_tokens``): ``fits`` per
    bound, and each rank's parts under each bound (:meth:`parts`). Every bound's pass is its own:
    the same alone or next to others."""

    def __init__(self, length: int, rank_tokens: torch.Tensor, cap: float, fills: torch.Tensor, mask: Mask,
                 bounds: torch.Tensor):
        self.length, self.mask, self.cap, self.fill = length, mask, cap, fills
        lo, hi = torch.zeros_like(bounds), torch.full_like(bounds, length)
        done, stuck = (torch.zeros(bounds.numel(), dtype=torch.bool) for _ in range(2))
        columns = []  # per rank: head [start, end) and tail [start, end) under every bound
        innermost = torch.zeros_like(bounds)  # per bound, the rank that takes the middle
        for r, tokens in enumerate(rank_tokens.t()):
            live = ~done & ~stuck
            if not bool(live.any()):
                break
            # the rest fits this rank (its prefix within the bound): it takes the middle
            last = live & (hi - lo <= tokens) & (lo <= bounds) & (self._cost(lo, hi, hi, hi, tokens) <= cap)
            t, ok = self._longest_tail(lo, hi, bounds, tokens)
            a = (hi - bounds - t).clamp(min=0)
            take, stuck = live & ~last & ok, stuck | (live & ~last & ~ok)
            head_end, tail_start = torch.where(take, lo + a, lo), torch.where(take, hi - t, hi)
            columns.append(torch.stack([lo, torch.where(last, hi, head_end), tail_start, hi]))
            done |= last
            innermost = torch.where(last, r, innermost)
            lo, hi = head_end, tail_start
        # The ranks inside the innermost one hold none of the document: filled up, each within the cap.
        inside = torch.cat([torch.cummax(rank_tokens.flip(1), 1).values.flip(1)[:, 1:],
                            rank_tokens.new_zeros(len(bounds), 1)], 1)
        self.fits = done & (fills * inside.gather(1, innermost[:, None])[:, 0].double() <= cap)
        self.columns = torch.stack(columns)  # [ranks, 4, bounds]

    def parts(self, i: int, doc: int) -> Pieces:
        """The parts under bound ``i``: rank r's head and tail, as pieces of document ``doc``."""
        c = self.columns[:, :, i]
        rank = torch.arange(c.shape[0]).repeat_interleave(2)
        start, end = c[:, 0::2].reshape(-1), c[:, 1::2].reshape(-1)
        return Pieces(rank, torch.full_like(rank, doc), start, end).select(end > start)

    def _work(self, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        return self.mask.row_work(start, end, self.length).double()

    def _cost(self, lo, head_end, tail_start, hi, tokens: torch.Tensor) -> torch.Tensor:
        """Work of a rank holding rows ``[lo, head_end)`` and ``[tail_start, hi)``, filled up to
        ``tokens`` (per bound) by other documents at the fill density."""
        held = (head_end - lo) + (hi - tail_start)
        fill = self.fill if held.dim() == 1 else self.fill[:, None]  # per bound (rows of a grid of tails)
        tokens = tokens if held.dim() == 1 else tokens[:, None]
        return self._work(lo, head_end) + self._work(tail_start, hi) + fill * (tokens - held).double()

    def _longest_tail(self, lo, hi, bounds, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per bound, the most last rows ``t`` a rank can hold with the head ``max(hi - K - t, 0)``
        the bound asks for, within its tokens and the work cap (the work grows with ``t``), and
        whether any ``t >= 1`` fits."""
        room = torch.minimum(hi - lo, tokens)
        lo, hi, bounds = lo[:, None], hi[:, None], bounds[:, None]

        def fits(t: torch.Tensor) -> torch.Tensor:
            a = (hi - bounds - t).clamp(min=0)
            return (a + t <= room[:, None]) & (self._cost(lo, lo + a, hi - t, hi, tokens) <= self.cap)

        return _longest(fits, room)


def _longest(fits: Callable[[torch.Tensor], torch.Tensor], most: torch.Tensor, points: int = TAIL_GRID
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the largest ``t`` in ``[1, most]`` that ``fits`` (called with ``t`` of shape
    ``[rows, k]``; monotone: a prefix of the ``t`` fit), found on a grid of ``points`` refined
    where it turns, and whether ``t = 1`` fits."""
    t_lo, t_hi = torch.ones_like(most)[:, None], most.clamp(min=1)[:, None]
    ok = fits(t_lo)
    steps = torch.arange(1, points + 1)
    while bool((t_lo < t_hi).any()):
        grid = t_lo + (t_hi - t_lo) * steps // points  # points in (t_lo, t_hi], the last t_hi
        fitting = fits(grid).sum(1, keepdim=True)  # a prefix of the grid (the work grows with t)
        t_lo, t_hi = (torch.where(fitting > 0, grid.gather(1, (fitting - 1).clamp(min=0)), t_lo),
                      torch.where(fitting < points, grid.gather(1, fitting.clamp(max=points - 1)) - 1, t_hi))
    return t_lo[:, 0], ok[:, 0]
