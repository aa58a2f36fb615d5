"""Whole documents packed by density, the heaviest trimmed: a candidate of the ``balanced`` planner.

Where every rank holds many documents (short documents, few ranks), whole documents balance
tokens and work by themselves but for a few: a document of 4k tokens can do 90% of a rank's
work in a quarter of its tokens, and the lightest documents of the layout may not fill the
rest of that rank within the cap. Under a causal mask a cut costs the rank holding the later
part the earlier part's length, so the cheap cut takes a short *run* off such a document, right
after a head about as long as the run: the holder of head and tail receives the run, the run's
holder the head before it (a head alone would shed a third of the work for as many keys)::

    items, densest first (work per token; a trimmed document is two: its run, and the rest)
      -> each to the rank with the most work left per token of room, among those it fits in
    what fits nowhere, lightest first -> cut into the rooms left, rank by rank (short prefixes)
    a rank over the cap -> the run of the document it holds most of grows by that much work;
                           packed again (at most ROUNDS times)

Where the lightest documents are too few to fill the rank around a heavy document, *heads* are:
cut the first few rows off some of the longest documents beforehand, and the packing places each
head and rest on its own; the heads, the lightest items of all, go where work is short. A head of
``h`` rows costs its rest's holder ``h`` keys, but does a fraction of the work of as many rows of
a whole document; one plan per head length and number of heads (:data:`HEADS`), the runs then
grown as above (pretrain layout #3 over 4 ranks: 2256 keys with runs alone, 414 with 18 heads of
64 rows).

The same packing runs around *placed* pieces (:func:`packings_around`): the nested parts of the
documents too big for a rank (:mod:`doccp.plan.nested`), fixed to their ranks beforehand, whose rows
and work each rank's room starts from. Where those parts leave many rooms of uneven tokens and work,
whole documents packed by density fill them closer than the sequence's cuts (lognormal layout #5
over 16 ranks: 2295 keys, where the sequence's plans receive 4217).

The sequence plans of :mod:`doccp.plan.balanced` cut a dense document at every rank boundary of
their front run, and the rank holding its last rows receives the rest (sft layout #7 over 8
ranks: 2846 keys, where this packing receives 447). Host work: O(items x N) per round, a few
rounds, only for at most :data:`TRIM_RANKS` ranks (and the heads' plans for at most
:data:`HEAD_DOCS` documents); the search scores the plans with its own.
"""

from __future__ import annotations

import copy
import heapq
import itertools
from collections.abc import Iterable, Iterator

import torch

from doccp.masks import Mask
from doccp.plan.pieces import Pieces, even_sizes

#: Most ranks the packing is tried for: beyond, ranks hold few documents each, and the greedy's
#: O(items x N) Python loop would cost more than the sequence plans it competes with.
TRIM_RANKS = 16
#: Most documents the packing is tried for (its greedy is a Python step per document and rank): a
#: batch of 1M tokens holds 400-1900 of the seeded mixes', where it still finds plans that receive
#: nothing (lognormal and sft layouts over 16 ranks: 0.27-0.63% of an all-gather -> 0); at 16M
#: tokens over 8 ranks (23k documents) it would double the planner's time for little to gain.
TRIM_DOCS = 2048
#: Most packings per variant: each round grows the runs of the ranks still over the cap (on the
#: seeded layouts of 131k tokens over 2-16 ranks, those that reach the cap do in at most 8 rounds
#: but for 7 of 205).
ROUNDS = 8
#: Where a run starts, in run lengths after the document's start: the rest's holder receives the
#: run, the run's holder the head before it. A run after a head of one run length sheds 3x the
#: work of a head as long (under a causal mask); which share sheds the most per key the busiest
#: rank receives depends on what else the ranks hold, so each is a plan of its own (the 160 seeded
#: layouts of 131k tokens over 2-16 ranks: heads alone (0) receive 0.17 of an all-gather less than
#: the other candidates in all; 0, 1 and 2: 0.33; these: 0.37).
RUN_STARTS = (0.75, 1.0, 1.5)
#: The packing aims this much under the planner's work tolerance (max/mean): its rounds then stop
#: with room to spare, and reach it more often (the 160 seeded layouts of 131k tokens over 2-16
#: ranks: 29 plans with less KV than the other candidates', not 26).
CAP_SLACK = 0.002
#: Heads cut off beforehand, one plan each: (rows per head, heads per rank but one). Short heads
#: where a little cheap fill is missing, long ones where much is; each rank then holds about that
#: many rests whose heads may lie elsewhere. (Of (8, 64) x (1, 4, 8) on the seeded layouts of 131k
#: tokens over 2-16 ranks, these three find every plan that receives less than the runs alone.)
HEADS = ((8, 4), (64, 4), (64, 8))
#: Documents doing more than this share of a rank's work keep their first rows: they are the ones
#: runs trim.
HEAD_WORK = 0.25
#: Most documents the heads' plans are tried for (3 more packings of a few rounds each, 1-10 ms
#: apiece on 131k tokens): at 1M tokens, 1500 documents, the runs alone find plans that receive
#: almost nothing.
HEAD_DOCS = 512


def trimmed_packings(lengths: torch.Tensor, doc_work: torch.Tensor, world_size: int, mask: Mask,
                     tolerance: float, heads: bool = False) -> list[Pieces]:
    """The packing's plan if every document stays whole, else one plan per run start
    (:data:`RUN_STARTS`) whose runs bring every rank within ``tolerance`` (max/mean work);
    ``doc_work``: every document's work under ``mask``. ``heads``: instead, one plan per way to cut
    heads off beforehand (:data:`HEADS`), for at most :data:`HEAD_DOCS` documents."""
    n, total = world_size, int(lengths.sum())
    if not _applies(lengths, n, mask, HEAD_DOCS if heads else TRIM_DOCS) or int(lengths.max()) > total // n:
        return []  # (a document longer than a rank spans ranks: not this shape)
    packing = Packing(lengths, doc_work, n, mask, tolerance)
    if not heads:
        return _grown(packing)
    cuts = {tuple(packing.heads(rows, per_rank).items()) for rows, per_rank in HEADS}
    return [p for p in (packing.solve(1.0, dict(cut)) for cut in sorted(cuts) if cut) if p is not None]


def packings_around(lengths: torch.Tensor, doc_work: torch.Tensor, world_size: int, mask: Mask, tolerance: float,
                    placements: Iterable[Pieces]) -> Iterator[list[Pieces]]:
    """Per placement (pieces fixed to their ranks beforehand: the nested parts of documents too big
    for a rank), the plans of :func:`trimmed_packings` packed around it, whose documents they leave
    alone; lazily, so that a caller may stop at the first placement that none balances (and the
    placements are not drawn at all where the packing is not tried, see :data:`TRIM_RANKS`). They
    share one packing's per-document tables."""
    n, total = world_size, int(lengths.sum())
    if not _applies(lengths, n, mask, TRIM_DOCS):
        return
    packing = Packing(lengths, doc_work, n, mask, tolerance)
    for placed in placements:
        loose = lengths.index_fill(0, placed.doc, 0)  # (the documents the packing places)
        yield _grown(packing.around(placed)) if int(loose.max()) <= total // n else []


def _applies(lengths: torch.Tensor, n: int, mask: Mask, most_docs: int) -> bool:
    """Whether the packing is tried at all (see :data:`TRIM_RANKS`, :data:`TRIM_DOCS`)."""
    return 2 <= n <= TRIM_RANKS and int(lengths.sum()) > 0 and not mask.looks_ahead and lengths.numel() <= most_docs


def _grown(packing: Packing) -> list[Pieces]:
    """The packing's plan if it balances as it is, else one per run start that its runs balance."""
    pieces, over = packing.balanced({})
    if pieces is not None:
        return [pieces]
    return [p for p in (packing.solve(start, {}, over) for start in RUN_STARTS) if p is not None]


class Packing:
    """The greedy packing of the module docstring for one layout (around placed pieces: :meth:`around`)."""

    def __init__(self, lengths: torch.Tensor, doc_work: torch.Tensor, n: int, mask: Mask, tolerance: float):
        self.lengths, self.n, self.mask = lengths, n, mask
        self.length, self.work = lengths.tolist(), doc_work.double().tolist()
        self.sizes = even_sizes(int(lengths.sum()), n).tolist()
        self.mean = sum(self.work) / n
        self.cap = (tolerance - CAP_SLACK) * self.mean
        self._prefix: dict[int, torch.Tensor] = {}
        self._prefix_rows: dict[int, list[float]] = {}
        self._runs: dict[tuple[int, float], tuple[list[int], torch.Tensor]] = {}
        self._items: dict[tuple[int, tuple[int, int]], tuple[tuple, tuple]] = {}
        # whole documents, densest first (each packing merges the trimmed ones' items in)
        self._whole = sorted((-w / size, d, ((0, size),), w, size)
                             for d, (w, size) in enumerate(zip(self.work, self.length, strict=True)) if size)
        self._place(None)

    def around(self, placed: Pieces) -> Packing:
        """This packing with ``placed`` pieces fixed to their ranks beforehand (their documents left
        alone, their rows and work packed around), sharing the per-document tables."""
        packing = copy.copy(self)
        packing._place(placed)
        return packing

    def _place(self, placed: Pieces | None) -> None:
        columns = () if placed is None else (placed.rank, placed.doc, placed.start, placed.end)
        self.placed = list(zip(*(c.tolist() for c in columns), strict=True))
        self.fixed = {d for _, d, _, _ in self.placed}  # (documents the packing leaves alone)
        self.whole = [item for item in self._whole if item[1] not in self.fixed]
        self._rooms: tuple[list[int], list[float]] | None = None

    def prefix_work(self, doc: int) -> torch.Tensor:
        """Work of the document's first ``k`` rows, for every ``k`` (cached: only cut documents)."""
        if doc not in self._prefix:
            costs = self.mask.row_costs(self.length[doc]).double()
            self._prefix[doc] = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(costs, 0)])
        return self._prefix[doc]

    def range_work(self, doc: int, a: int, b: int) -> float:
        if a == 0 and b == self.length[doc]:
            return self.work[doc]
        if doc not in self._prefix_rows:  # (a list: a packing reads a few entries of many documents)
            self._prefix_rows[doc] = self.prefix_work(doc).tolist()
        prefix = self._prefix_rows[doc]
        return prefix[b] - prefix[a]

    def balanced(self, runs: dict[int, tuple[int, int]]) -> tuple[Pieces | None, tuple]:
        """The packing with these runs cut off: its pieces if no rank is over the cap, else each
        rank's excess work and the (rank, doc, start, end) pieces."""
        pieces = self.pack(runs)
        rank, doc, a, b = (torch.tensor(c, dtype=torch.int64) for c in zip(*pieces, strict=True))
        work = torch.zeros(self.n, dtype=torch.float64).index_add_(
            0, rank, self.mask.row_work(a, b, self.lengths[doc]).double())
        over = (work - self.cap).tolist()
        return (Pieces(rank, doc, a, b), ()) if max(over) <= 0 else (None, (over, pieces))

    def heads(self, rows: int, per_rank: int) -> dict[int, tuple[int, int]]:
        """``doc -> (0, rows)``: heads to cut off the ``per_rank * (N - 1)`` longest documents lighter
        than :data:`HEAD_WORK` of a rank's work and longer than ``4 * rows`` (as runs at row 0)."""
        light = (d for _, d in sorted((-size, d) for d, size in enumerate(self.length))
                 if self.work[d] < HEAD_WORK * self.mean and self.length[d] > 4 * rows and d not in self.fixed)
        return {d: (0, rows) for d in itertools.islice(light, per_rank * (self.n - 1))}

    def solve(self, start: float, heads: dict[int, tuple[int, int]], packed: tuple = ()) -> Pieces | None:
        """Runs starting ``start`` run lengths into their documents, grown from the packing with
        ``heads`` cut off (``packed``: its excess and pieces, of :meth:`balanced`, where known) a
        round at a time until no rank is over the cap; None after :data:`ROUNDS`, or once a round
        leaves no less excess. Documents with a head keep it, and grow no run."""
        runs = dict(heads)  # doc -> its run [a, b)
        if not packed:
            result, packed = self.balanced(runs)
            if result is not None:
                return result
        excess = float("inf")
        for _ in range(ROUNDS):
            (over, pieces), before = packed, excess
            excess = sum(x for x in over if x > 0)
            if excess >= before:
                return None
            held: dict[int, dict[int, int]] = {}  # rank over the cap -> rows it holds of each document
            for r, d, x, y in pieces:  # (a document of one row has no run to cut off)
                if over[r] > 0 and self.length[d] > 1 and d not in heads and d not in self.fixed:
                    mine = held.setdefault(r, {})
                    mine[d] = mine.get(d, 0) + y - x
            for r in sorted(held):
                mine = held[r]
                d = max(mine, key=lambda d: (mine[d], d))
                runs[d] = self.grown(d, runs.get(d), over[r], start)
            result, packed = self.balanced(runs)
            if result is not None:
                return result
        return None

    def pack(self, runs: dict[int, tuple[int, int]]) -> list[tuple[int, int, int, int]]:
        """(rank, doc, start, end) of every piece: the items (whole documents, and each trimmed one
        as its run and the rest, head and tail together) densest first, each to the rank with the
        most work left per token of room that it fits in; the rest cut into the rooms left."""
        n, target = self.n, self.mean
        trimmed = sorted(item for d, run in runs.items() for item in self.trimmed(d, run))
        items = heapq.merge((item for item in self.whole if item[1] not in runs), trimmed)
        room, work = self._placed_rooms()
        density = [(target - w) / size if size else 0.0 for w, size in zip(work, room, strict=True)]  # work left
        pieces, left = list(self.placed), []  # per token of room
        for _, d, ranges, w, size in items:
            best, best_density = -1, 0.0
            for r in range(n):
                if room[r] >= size and (best < 0 or density[r] > best_density):
                    best, best_density = r, density[r]
            if best < 0:
                left += [(self.range_work(d, a, b) / (b - a), d, a, b) for a, b in ranges]
                continue
            room[best] -= size
            work[best] += w
            density[best] = (target - work[best]) / room[best] if room[best] else 0.0
            pieces += [(best, d, a, b) for a, b in ranges]
        left.sort()
        r = 0
        for _, d, a, b in left:  # the lightest first, cut into the rooms in rank order
            while a < b:
                while room[r] == 0:
                    r += 1
                take = min(room[r], b - a)
                pieces.append((r, d, a, a + take))
                room[r] -= take
                a += take
        return pieces

    def _placed_rooms(self) -> tuple[list[int], list[float]]:
        """Every rank's tokens and work left beside the placed pieces (fresh lists)."""
        if self._rooms is None:
            room, work = list(self.sizes), [0.0] * self.n
            for r, d, a, b in self.placed:
                room[r] -= b - a
                work[r] += self.range_work(d, a, b)
            self._rooms = room, work
        return list(self._rooms[0]), list(self._rooms[1])

    def trimmed(self, doc: int, run: tuple[int, int]) -> tuple[tuple, tuple]:
        """The items of a document with ``run`` cut off: the rest (head and tail together) and the
        run (cached: a packing's rounds keep most runs, and heads, as they are)."""
        if (doc, run) not in self._items:
            a, b = run
            rest = tuple((x, y) for x, y in ((0, a), (b, self.length[doc])) if y > x)
            items = []
            for ranges in (rest, (run,)):
                w, size = sum(self.range_work(doc, x, y) for x, y in ranges), sum(y - x for x, y in ranges)
                items.append((-w / size, doc, ranges, w, size))
            self._items[doc, run] = tuple(items)
        return self._items[doc, run]

    def grown(self, doc: int, run: tuple[int, int] | None, shed: float, start: float) -> tuple[int, int]:
        """The shortest run starting ``start`` run lengths into the document (or less, to fit) that
        sheds ``shed`` more work than ``run`` (the next packing places the new run and rest afresh,
        so it need not contain the old run); the document's rows but its first where none does."""
        length = self.length[doc]
        if (doc, start) not in self._runs:  # every run of k = 1 .. L - 1 rows: where it starts, and the
            prefix = self.prefix_work(doc)  # most work any of the first k sheds (rises with k)
            k = torch.arange(1, length)
            a = torch.minimum(torch.round(k * start).long(), length - k)
            self._runs[doc, start] = a.tolist(), torch.cummax(prefix[a + k] - prefix[a], 0).values
        starts, most = self._runs[doc, start]
        if run is not None:
            shed += self.range_work(doc, *run)
        k = int(torch.searchsorted(most, shed)) + 1  # the first run that sheds it
        return (starts[k - 1], starts[k - 1] + k) if k < length else (1, length)
