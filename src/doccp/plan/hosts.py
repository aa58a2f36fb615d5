"""Heavy documents hosted whole, their ranks filled with cheap rows: a candidate of the ``balanced`` planner.

A document of 4k tokens can do 85% of a rank's work in a quarter of its tokens, and its rank must
fill the other three quarters with the remaining 15%: the cheapest rows of the layout. Short whole
documents are cheap (under a causal mask a document of ``l`` rows costs about ``l / 2`` per row), and
the first rows of any document are cheaper still, but a *head* cut off a document costs the holder
of its rest as many keys as the head has rows. Where two such documents compete for too few short
ones, the packings of :mod:`doccp.plan.trims` cut runs off them, and the ranks holding the runs'
documents receive hundreds of keys each (lognormal layout #5 over 8 ranks: documents of 4280 and 4212
tokens, 450 keys). Here every other rank instead gives an equal share of heads, cut short off many
of its documents, and receives just that share (154 keys)::

    hosts      each heavy document alone on a rank (the heaviest first, at most N - 1), and the
               cheapest whole documents, biggest first, to the host with the most work left per
               token of room: as many as leave every host within the cap once the heads are in
    the others every other document whole, densest first, in rooms of their tokens plus an equal
               share of the heads; then moves and swaps of whole documents between them even out
               the tokens each holds beyond its share (its excess)
    heads      each of the others cuts its excess off its whole documents, a few first rows of each
               (the cheapest rows); the heads fill the hosts' rooms

How many whole documents fill the hosts is a binary search: fewer leave the hosts less work (their
rooms take more heads) and the others more. It starts at the most that the hosts' cap allows with
the least work heads could add, where the others fare best: where they fail there, there is no
plan (on the sft layouts over 16 ranks, one attempt instead of seven). Host work: O(documents x N)
Python per attempt, a few attempts, only for at most :data:`doccp.plan.trims.TRIM_RANKS` ranks and
:data:`doccp.plan.trims.TRIM_DOCS` documents; the planner's search scores the plans with its own.
"""

from __future__ import annotations

import bisect

import torch

from doccp.masks import Mask
from doccp.plan.pieces import Pieces
from doccp.plan.trims import TRIM_DOCS, TRIM_RANKS, Packing

#: Documents doing more than this share of a rank's work (and at most the cap) are hosted, one plan
#: per share: at 0.7 only the heaviest, which need the cheapest fill (lognormal #5 over 8 ranks, two
#: of 0.87 and 0.84); at 0.5 also those a rank fills with ordinary documents (lognormal #6 over 5 ranks:
#: 690 -> 558 keys).
HOST_SHARES = (0.5, 0.7)
#: Most moves or swaps that even the others' excess tokens, per rank (each takes the rank with the
#: most excess and the move that lowers it most; the seeded layouts of 131k tokens over 2-16 ranks
#: converge in fewer).
EVEN_MOVES = 4
#: Most first rows whose work :meth:`_Hosting._most_whole` tables (the bound it draws from them only
#: starts the search, and every plan is checked exactly).
HEAD_TABLE = 1 << 16


def hosted_packings(lengths: torch.Tensor, doc_work: torch.Tensor, world_size: int, mask: Mask,
                    tolerance: float) -> list[Pieces]:
    """One plan per set of heavy documents (:data:`HOST_SHARES`) that hosting balances within
    ``tolerance`` (max/mean work); ``doc_work``: every document's work under ``mask``. None where a
    document is longer than a rank's share, for a mask that looks ahead (a head's holder would need
    its rest too), or for more than :data:`~doccp.plan.trims.TRIM_RANKS` ranks or
    :data:`~doccp.plan.trims.TRIM_DOCS` documents."""
    n, total = world_size, int(lengths.sum())
    if n < 2 or n > TRIM_RANKS or total == 0 or mask.looks_ahead or lengths.numel() > TRIM_DOCS:
        return []
    if int(lengths.max()) > total // n:
        return []
    hosting = _Hosting(Packing(lengths, doc_work, n, mask, tolerance))
    plans, tried = [], set()
    for share in HOST_SHARES:
        heavy = hosting.heavy(share)
        if heavy and heavy not in tried:
            tried.add(heavy)
            plan = hosting.solve(heavy)
            if plan is not None:
                plans.append(plan)
    return plans


class _Failed(Exception):
    """An attempt that does not balance: ``fewer`` when the hosts need fewer whole documents."""

    def __init__(self, fewer: bool):
        super().__init__()
        self.fewer = fewer


class _Hosting:
    """The hosting of the module docstring for one layout, on a :class:`Packing`'s figures."""

    def __init__(self, packing: Packing):
        self.p = packing
        self.smallest_rank = min(packing.sizes)

    def heavy(self, share: float) -> tuple[int, ...]:
        """The documents doing more than ``share`` of a rank's work that a rank can hold whole, the
        heaviest first, at most N - 1."""
        p = self.p
        docs = [d for d, w in enumerate(p.work) if share * p.mean < w <= p.cap and p.length[d] <= self.smallest_rank]
        return tuple(sorted(docs, key=lambda d: (-p.work[d], d))[: p.n - 1])

    def solve(self, heavy: tuple[int, ...]) -> Pieces | None:
        """The plan with the most whole documents on the hosts that balances, None if none does."""
        p = self.p
        room = sum(p.sizes[r] - p.length[d] for r, d in enumerate(heavy))
        cheapest = [d for _, d in sorted((p.work[d] / p.length[d], d) for d in range(len(p.length))
                                         if p.length[d] and d not in heavy)]
        most, tokens = 0, 0  # the most of them that fit the hosts' rooms at all
        while most < len(cheapest) and tokens + p.length[cheapest[most]] <= room:
            tokens += p.length[cheapest[most]]
            most += 1
        # The others fare best with the most whole documents on the hosts (the least work left to
        # them): tried first, where they fail they fail with fewer too, and the search stops.
        lo, hi, best = 0, self._most_whole(heavy, cheapest[:most], room), None
        whole = hi
        while lo <= hi:
            try:
                best = self.attempt(heavy, cheapest[:whole])
                lo = whole + 1
            except _Failed as failed:
                if failed.fewer:
                    hi = whole - 1
                else:
                    lo = whole + 1
            whole = (lo + hi) // 2
        return best

    def _most_whole(self, heavy: tuple[int, ...], cheapest: list[int], room: int) -> int:
        """The most of the ``cheapest`` documents (in order) whose hosts could stay within the cap at
        all: with them, the heavy documents and the least work the heads filling the rest of the
        rooms can add (as even as they go over every other document, where a document's first rows
        cost no less the further down they are), within every host's cap together."""
        p, hosts = self.p, len(heavy)
        longest = min(max(p.length), room + 1, HEAD_TABLE)  # (longer heads: at least this much)
        costs = p.mask.row_costs(longest).double()
        first = [0.0, *torch.cumsum(costs, 0).tolist()] if bool((costs[1:] >= costs[:-1]).all()) else None
        work = sum(p.work[d] for d in heavy) + sum(p.work[d] for d in cheapest)
        tokens = sum(p.length[d] for d in cheapest)
        taken = {*heavy, *cheapest}
        givers = sum(1 for d in range(len(p.length)) if p.length[d] > 1 and d not in taken)
        for whole in range(len(cheapest), 0, -1):  # (the documents not on the hosts give the heads)
            heads, least = room - tokens, 0.0
            if first is not None and heads and givers:
                per, rest = divmod(heads, givers)
                least = (givers - rest) * first[min(per, longest)] + rest * first[min(per + 1, longest)]
            if work + least <= hosts * p.cap:
                return whole
            d = cheapest[whole - 1]
            work, tokens, givers = work - p.work[d], tokens - p.length[d], givers + (p.length[d] > 1)
        return 0

    def attempt(self, heavy: tuple[int, ...], fill: list[int]) -> Pieces:
        """The plan with ``heavy`` hosted and ``fill`` on the hosts whole; raises :class:`_Failed`."""
        p, n, hosts = self.p, self.p.n, len(heavy)
        room, work = list(p.sizes), [0.0] * n  # (work is a guide here: the plan's is summed exactly at the end)
        pieces: list[tuple[int, int, int, int]] = []

        def put(r: int, d: int, a: int, b: int, w: float) -> None:
            pieces.append((r, d, a, b))
            room[r] -= b - a
            work[r] += w

        def roomiest(size: int) -> int | None:  # the host with the most work left per token of room that fits
            fits = [r for r in range(hosts) if room[r] >= size]
            return max(fits, key=lambda r: ((p.cap - work[r]) / room[r], -r)) if fits else None

        for r, d in enumerate(heavy):
            put(r, d, 0, p.length[d], p.work[d])
        for d in sorted(fill, key=lambda d: (-p.length[d], d)):
            r = roomiest(p.length[d])
            if r is None:
                raise _Failed(fewer=True)
            put(r, d, 0, p.length[d], p.work[d])
        if max(work[:hosts]) > p.cap:  # over already, before the heads
            raise _Failed(fewer=True)
        held, excess = self._others(heavy, fill, room)
        cut = [(r, d, rows) for r, docs in held.items()
               for d, rows in zip(docs, _even_heads(excess[r], [p.length[d] for d in docs]), strict=True)]
        heads = [(d, rows) for _, d, rows in cut if rows]
        head_work = dict(zip((d for d, _ in heads), self._work([(d, 0, rows) for d, rows in heads]), strict=True))
        for r, d, rows in cut:
            put(r, d, rows, p.length[d], p.work[d] - head_work.get(d, 0.0))
        for d, rows in sorted(heads, key=lambda h: (-h[1], h[0])):  # biggest first; split where none fits
            a = 0
            while a < rows:
                r = roomiest(rows - a)
                r = max(range(hosts), key=lambda r: (room[r], -r)) if r is None else r
                take = min(room[r], rows - a)
                put(r, d, a, a + take, head_work[d] * take / rows)
                a += take
        rank, doc, start, end = (torch.tensor(c, dtype=torch.int64) for c in zip(*pieces, strict=True))
        exact = torch.zeros(n, dtype=torch.float64).index_add_(
            0, rank, p.mask.row_work(start, end, p.lengths[doc]).double())
        if float(exact[:hosts].max()) > p.cap:
            raise _Failed(fewer=True)
        if float(exact.max()) > p.cap:
            raise _Failed(fewer=False)
        return Pieces(rank, doc, start, end)

    def _work(self, ranges: list[tuple[int, int, int]]) -> list[float]:
        """The work of each ``(doc, start, end)``, in one pass."""
        if not ranges:
            return []
        doc, start, end = (torch.tensor(c, dtype=torch.int64) for c in zip(*ranges, strict=True))
        return self.p.mask.row_work(start, end, self.p.lengths[doc]).double().tolist()

    def _others(self, heavy: tuple[int, ...], fill: list[int], host_room: list[int]
                ) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Every other document whole on the ranks after the hosts: ``(documents per rank, the
        tokens each holds beyond its share)``, the excess as even as moves and swaps make it."""
        p, n, hosts = self.p, self.p.n, len(heavy)
        others = range(hosts, n)
        heads = sum(host_room[:hosts])
        share = {r: heads // (n - hosts) + (i < heads % (n - hosts)) for i, r in enumerate(others)}
        taken = {*heavy, *fill}
        tokens, work = {r: 0 for r in others}, {r: 0.0 for r in others}
        held: dict[int, list[int]] = {r: [] for r in others}
        rest = [d for d in range(len(p.length)) if p.length[d] and d not in taken]
        left = {r: p.sizes[r] + share[r] for r in others}
        for _, d in sorted((-p.work[d] / p.length[d], d) for d in rest):  # densest first
            size, r, most = p.length[d], None, 0.0
            for o in others:  # the most work left per token of room, where it fits
                if left[o] >= size and (r is None or (p.mean - work[o]) / left[o] > most):
                    r, most = o, (p.mean - work[o]) / left[o]
            if r is None:  # room runs out: the most left
                r = max(others, key=lambda o: (left[o], -o))
            tokens[r] += size
            left[r] -= size
            work[r] += p.work[d]
            held[r].append(d)
        for _ in range(EVEN_MOVES * (n - hosts)):
            excess = {r: tokens[r] - p.sizes[r] for r in others}
            top = max(others, key=lambda r: (excess[r], -r))
            move = None
            for to in sorted(others, key=lambda r: (excess[r], r)):  # the least excess first
                if excess[top] - excess[to] < 2:
                    break
                move = self._move(held[top], held[to], excess[top] - excess[to], work[top], work[to])
                if move is not None:
                    break
            if move is None:
                break
            a, b = move
            for d, src, dst in ((a, top, to), (b, to, top)):
                if d is not None:
                    held[src].remove(d)
                    held[dst].append(d)
                    tokens[src], tokens[dst] = tokens[src] - p.length[d], tokens[dst] + p.length[d]
                    work[src], work[dst] = work[src] - p.work[d], work[dst] + p.work[d]
        excess = {r: tokens[r] - p.sizes[r] for r in others}
        if min(excess.values()) < 0:
            raise _Failed(fewer=False)
        return held, excess

    def _move(self, top: list[int], to: list[int], gap: int, top_work: float, to_work: float
              ) -> tuple[int, int | None] | None:
        """``(a, b)``: the document of ``top`` to move to ``to`` and the one of ``to`` to move back
        (None: none) that bring their excess closest together, ``gap`` apart now, within the cap."""
        p = self.p
        back = sorted((p.length[b], b) for b in to)
        best, best_after = None, gap
        for a in top:
            want = p.length[a] - gap // 2  # the length to send back that evens them best
            i = bisect.bisect_left(back, (want, -1))
            for b in [None, *(back[k][1] for k in range(max(i - 2, 0), min(i + 2, len(back))))]:
                size = p.length[a] - (0 if b is None else p.length[b])
                load = p.work[a] - (0.0 if b is None else p.work[b])
                after = max(gap - size, size)  # the larger excess of the two after, less the smaller's now
                if 0 < size < gap and after < best_after and to_work + load <= p.cap and top_work - load <= p.cap:
                    best, best_after = (a, b), after
        return best


def _even_heads(rows: int, lengths: list[int]) -> list[int]:
    """Heads of ``rows`` rows in all off documents of ``lengths``, as even as they go (each keeps a
    row at least): the first rows are a document's cheapest, so many short heads cost least."""
    heads = [0] * len(lengths)
    can = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # the shortest run out first
    while rows and can:
        per, rest = divmod(rows, len(can))
        short = [i for i in can if lengths[i] - 1 - heads[i] < per + (rest > 0)]
        if not short:  # every one takes its share
            for k, i in enumerate(can):
                heads[i] += per + (k < rest)
            return heads
        for i in short:  # these give all they can
            rows -= lengths[i] - 1 - heads[i]
            heads[i] = lengths[i] - 1
        can = [i for i in can if i not in short]
    if rows:
        raise _Failed(fewer=False)
    return heads
