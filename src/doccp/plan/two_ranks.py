"""Two ranks, one document cut: a candidate of the ``balanced`` planner for N = 2, causal mask.

These plans cut one document ``d`` (the rest stay whole, on one rank or the other: with two
ranks, one cut fixes the tokens and its shape the work). Under a causal mask, the rank *A*
holding d's last row receives every row of d it lacks: ``L - a`` for its ``a`` rows. The other
rank, *B*, receives the rows of d that A holds below B's highest row. For ``a`` rows on A, B
receives least when A's rows are a head ``[0, h)`` and a tail ``[L - t, L)`` (``h + t = a``; B
holds the middle and receives ``h``), and A's work is then linear in the tail: ``a (a + 1) / 2 +
t (L - a)``. So once the whole documents on A are chosen (``tau`` tokens, ``omega`` work), ``a``
is what A's tokens leave, the longest tail its work allows fixes ``h``, and the plan receives
``max(L - a, h)``::

    d over 2 ranks, with whole documents w on A and v on B
    rank A:  d[0, h)              d[L - t, L)   w w w      receives d[h, L - t)
    rank B:         d[h, L - t)                 v v v v    receives d[0, h)

Which whole documents go with the head and tail is a two-dimensional subset sum (tokens and
work). A local search picks it: from a few starts (:func:`_starts`), the best single move or swap
of documents between the ranks (all of them scored at once, with the formula above), while it
lowers the KV; every start of every document tried as the cut one (the one too big to stay whole,
else the longest few) in one batch. On the seeded layouts of 131k tokens over two ranks this finds
what the sequence, packings and nested parts miss, within 0.003 of the lower bound on 7 of the 10
layouts it improves: a dense whole document beside a shorter head and tail (long mix #4: 0.506 ->
0.395 of an all-gather, bound 0.374), or a document cut near its start (pretrain #1: 0.098 ->
0.038).
"""

from __future__ import annotations

import torch

from doccp.plan.pieces import Pieces

#: Documents tried as the cut one when every document could stay whole: the longest few (a long
#: one has room for the tokens the whole ones leave over).
CUT_CANDIDATES = 8
#: Documents per rank whose swaps the local search scores (the longest: they move the most).
SWAP_DOCS = 32
#: Most moves per local search.
MOVES = 64
#: Starts of the local search per cut document (see :func:`_starts`).
STARTS = 4
#: Infeasible totals score above ``PENALTY * L`` (every feasible one scores at most ``L``).
PENALTY = 4.0
#: Share of the mean work A's total may be off by (of the planner's 1% tolerance: the rest covers
#: rounding the tail to whole rows).
WORK_SLACK = 0.008


def two_rank_plans(lengths: torch.Tensor, doc_work: torch.Tensor, whole: torch.Tensor,
                   rank_tokens: int) -> list[Pieces]:
    """Plans over ranks 0 (A, holding the cut document's head and tail) and 1 (the middle), one
    per document tried as the cut one, each with the whole documents the local search chose.
    ``doc_work``: every document's causal work; ``rank_tokens``: rank 0's tokens."""
    must = torch.nonzero(~whole & (lengths > 0)).flatten()
    if must.numel() > 1:  # two documents too big to stay whole over two ranks: not this shape
        return []
    cut = must if must.numel() else torch.argsort(lengths, descending=True, stable=True)[:CUT_CANDIDATES]
    cut = cut[lengths[cut] > 0]
    total_work, work = float(doc_work.sum()), doc_work.double()
    # One row per (cut document, start): its own columns, the cut document's zeroed.
    rows = cut.repeat_interleave(STARTS)
    other = (lengths > 0).expand(rows.numel(), -1).clone()
    other[torch.arange(rows.numel()), rows] = False
    size, work = torch.where(other, lengths, 0), torch.where(other, work, 0.0)
    length = lengths[rows]
    on_a = _starts(size, rank_tokens - length // 2).reshape(rows.numel(), -1) & other
    kv = _local_search(on_a, size, work, length, rank_tokens, total_work)
    plans = []
    for d in cut.tolist():  # each cut document's best start, where it is balanced
        mine = torch.nonzero(rows == d).flatten()
        best = mine[int(torch.argmin(kv[mine]))]
        if float(kv[best]) <= PENALTY * int(lengths[d]):
            plans.append(_pieces(lengths, d, on_a[best], rank_tokens, total_work, doc_work))
    return plans


def _kv(tau: torch.Tensor, omega: torch.Tensor, length: torch.Tensor, rank_tokens: int, total_work: float
        ) -> torch.Tensor:
    """The KV of the shape above for whole documents of ``tau`` tokens and ``omega`` work on A,
    the cut document of ``length`` tokens (elementwise, broadcast); infeasible totals score above
    ``PENALTY * length``, by how far off they are."""
    a = (rank_tokens - tau).double()
    length = length.double()
    head_only = a * (a + 1) / 2  # A's rows of d all head: its least work
    mean = total_work / 2
    lo, hi = mean * (1 - WORK_SLACK) - omega, mean * (1 + WORK_SLACK) - omega  # d's work on A
    most = head_only + a * (length - a)  # all tail
    tail = torch.floor((torch.minimum(hi, most) - head_only) / (length - a).clamp(min=1))
    kv = torch.maximum(length - a, a - tail)  # A receives the middle, B the head
    whole_on = (a == 0) | (a == length)  # d held whole by one rank: no KV, its work where it is
    held = torch.where(a == 0, 0.0, most)
    work_off = torch.where(whole_on, (lo - held).clamp(min=0) + (held - hi).clamp(min=0),
                           (lo - most).clamp(min=0) + (head_only - hi).clamp(min=0))
    token_off = (-a).clamp(min=0) + (a - length).clamp(min=0)
    feasible = (work_off == 0) & (token_off == 0)
    penalty = PENALTY * length + 1 + token_off + work_off / max(mean, 1.0) * length
    return torch.where(feasible, torch.where(whole_on, 0.0, kv), penalty)


def _local_search(on_a: torch.Tensor, size: torch.Tensor, work: torch.Tensor, length: torch.Tensor,
                  rank_tokens: int, total_work: float) -> torch.Tensor:
    """Every row's local search of the module docstring at once, in place on ``on_a`` (rows of
    whole documents on A; ``size``, ``work``: per row, 0 for documents not to move); each row's
    KV by :func:`_kv` at its end. A move per round and row: the best flip of one document or swap
    of two (among each rank's :data:`SWAP_DOCS` longest), while it lowers the row's KV."""
    docs = on_a.shape[1]
    pick = min(SWAP_DOCS, docs)
    tau, omega = (size * on_a).sum(1), (work * on_a).sum(1)
    kv = _kv(tau, omega, length, rank_tokens, total_work)
    active = torch.nonzero(kv > 0).flatten()  # rows still moving
    for _ in range(MOVES):
        if active.numel() == 0:
            break
        mine, sz, wk, n = on_a[active], size[active], work[active], length[active]
        movable = sz > 0
        t, o = tau[active], omega[active]
        sign = torch.where(mine, -1, 1)
        flips = _kv(t[:, None] + sign * sz, o[:, None] + sign * wk, n[:, None], rank_tokens,
                    total_work).masked_fill_(~movable, float("inf"))
        a_docs = torch.topk(torch.where(mine & movable, sz, -1), pick, 1).indices
        b_docs = torch.topk(torch.where(~mine & movable, sz, -1), pick, 1).indices
        valid = (mine & movable).gather(1, a_docs)[:, :, None] & (~mine & movable).gather(1, b_docs)[:, None, :]
        swaps = _kv(t[:, None, None] - sz.gather(1, a_docs)[:, :, None] + sz.gather(1, b_docs)[:, None, :],
                    o[:, None, None] - wk.gather(1, a_docs)[:, :, None] + wk.gather(1, b_docs)[:, None, :],
                    n[:, None, None], rank_tokens, total_work).masked_fill_(~valid, float("inf")).flatten(1)
        flip_kv, flip = flips.min(1)
        swap_kv, swap = swaps.min(1)
        moved_kv = torch.minimum(flip_kv, swap_kv)
        better = moved_kv < kv[active]
        by_swap = better & (swap_kv < flip_kv)
        by_flip = better & ~by_swap
        every = torch.arange(active.numel())
        mine[every[by_flip], flip[by_flip]] ^= True
        s = swap[by_swap]
        mine[every[by_swap], a_docs[by_swap, s // pick]] = False
        mine[every[by_swap], b_docs[by_swap, s % pick]] = True
        on_a[active] = mine
        tau[active], omega[active] = (sz * mine).sum(1), (wk * mine).sum(1)
        kv[active] = torch.where(better, moved_kv, kv[active])
        active = active[better & (moved_kv > 0)]
    return kv


def _starts(size: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Where each row's local search starts, :data:`STARTS` rows per cut document in turn: every
    document on B; every one on A; dealt out longest first, A B B A A B B ..., so both ranks
    hold about as many tokens and as much work; and A filled with the longest documents that
    leave it half the cut document's length (``tokens``)."""
    rows, docs = size.shape
    order = torch.argsort(size, dim=1, descending=True, stable=True)
    ranked = torch.empty_like(order).scatter_(1, order, torch.arange(docs).expand(rows, -1).contiguous())
    dealt = (ranked + 1) % 4 < 2
    filled = torch.zeros_like(dealt)
    for r in range(0, rows, STARTS):  # the fill: a greedy over the documents, longest first
        left = int(tokens[r + 3])
        for doc, length in zip(order[r + 3].tolist(), size[r + 3][order[r + 3]].tolist(), strict=True):
            if 0 < length <= left:
                filled[r + 3, doc], left = True, left - length
    kind = torch.arange(rows) % STARTS
    return torch.where((kind == 0)[:, None], False,
                       torch.where((kind == 1)[:, None], True, torch.where((kind == 2)[:, None], dealt, filled)))


def _pieces(lengths: torch.Tensor, d: int, on_a: torch.Tensor, rank_tokens: int, total_work: float,
            doc_work: torch.Tensor) -> Pieces:
    """The plan: whole documents on their rank, ``d`` cut into A's head and tail and B's middle."""
    length = int(lengths[d])
    a = rank_tokens - int(lengths[on_a].sum())
    omega = float(doc_work[on_a].sum())
    head_only = a * (a + 1) / 2
    w = min(total_work / 2 * (1 + WORK_SLACK) - omega, head_only + a * (length - a))
    tail = 0 if a in (0, length) else max(min(int((w - head_only) // (length - a)), a), 0)
    head = a - tail if a < length else length
    others = torch.nonzero(lengths > 0).flatten()
    others = others[others != d]
    rank = (~on_a[others]).long()
    doc = torch.cat([others, torch.tensor([d, d, d])])
    start = torch.cat([torch.zeros_like(others), torch.tensor([0, length - tail, head])])
    end = torch.cat([lengths[others], torch.tensor([head, length, length - tail])])
    pieces = Pieces(torch.cat([rank, torch.tensor([0, 0, 1])]), doc, start, end)
    return pieces.select(pieces.end > pieces.start)
