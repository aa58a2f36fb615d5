"""A lower bound on the KV the most-loaded rank must receive, for any balanced plan.

Any plan that keeps tokens per rank within one and work max/mean <= 1.01 gives every rank at
least ``F = T // N`` tokens and at most ``cap`` work. Take the rank A that holds the query row
``p`` of a document that sees the most keys. Its work is at least row ``p``, plus the cheapest
other rows of the document it holds, plus the cheapest ``F - n`` rows of *other* documents that
fill it up to ``F`` tokens (the *fill*). So A holds at most ``n`` tokens of the document, the
largest ``n`` for which that least work fits the cap, and receives at least ``keys(p) - n`` of
the keys row ``p`` sees::

    causal, L = 10 and 20 one-token documents over 2 ranks (F = 15, cap = 1.01 * 75 / 2 = 37.9):
    row 9 costs 10; with n = 5 rows of the document, 1 + 2 + 3 + 4 + 10 = 20, plus a fill of
    10 one-token rows: 30 <= 37.9; n = 6: 15 + 10 + 9 = 34; n = 7: 21 + 10 + 8 = 39 > 37.9. So
    n <= 6 and A receives at least 10 - 6 = 4 keys.

Where every row sees its document from key 0 up to itself (causal, full), a second figure holds
too: let ``m`` rows at the document's end be all on row ``L - 1``'s rank A (they are, up to the
highest row ``p`` another rank B holds). A receives every key it does not hold, ``L - n``; B
receives the keys up to ``p`` that A holds, at least ``n - m``; so the worse of the two receives
at least ``(L - m) / 2``, and ``m`` is capped by the work of the document's last rows plus the
cheapest ``F - m`` other rows of the layout (its own earlier ones included)::

    causal, 2 ranks, a document of 100 tokens and 100 of 1 token; a rank may do 2600 pairs and
    holds at least 100 tokens: the last 29 rows cost 2494, plus 71 rows of cost 1: 2565; the last
    30 cost 2565, plus 70: 2635. So m <= 29 and some rank receives at least (100 - 29) / 2, 36
    keys (the balanced planner's head + tail plan receives 41).

A third figure holds for the same masks, and turns the question around: could a plan exist
in which no rank receives more than ``K`` keys? If A holds the last ``s`` rows of a document of
``L`` tokens and ``j`` more below them (of the ``L - s`` there are), the holder of the highest
row A lacks receives those ``j``, so ``j <= K``, and A itself receives ``L - s - j <= K``.
Likewise every row A holds of another document below that document's highest row A lacks is
received by some other rank: A holds at most ``(N - 1) K`` such *single* rows in all, and every
other row it holds (a document whole, or its last rows) costs at least its document's mean. So
A's work is at least the last ``s`` rows, plus the first ``j`` rows, plus the cheapest
``F - s - j`` fill rows under that budget (the mix of single rows and mean rows is convex, so a
bisection finds it); if no ``s`` and ``j`` fit the cap, no such plan exists (a range of ``j`` is
charged its least first rows and the fill of its largest ``j``, a lower bound for each, and cut
into parts only where that fits). The least ``K`` every document allows is a bound (allowing
more keys never hurts, so it is found by bisection)::

    causal, 2 ranks, 4, 3, 2 and 1 tokens (F = 5, cap 10.1): with K = 1 the 4-token document's
    last row needs s + j >= 3 of its rows on its rank A. The last 3 rows cost 9, plus 2 fill rows
    (at least 2): 11. The last 2 and the first (j = 1): 7 + 1, plus 2 rows at their documents'
    means (no single row is left: the other rank receives the first row) 1 + 1.5: 10.5. All 4
    rows: 10 + 1. None fits 10.1, so some rank receives 2 keys, the optimum (the first figure
    gives 1).

A fourth figure follows the ranks that hold a document's top rows, where no one rank can hold
all of it. Let ``A_1`` hold its last row and ``A_k`` the highest row ``q`` that ``A_1 .. A_{k-1}``
lack (every row above ``q`` is theirs, so ``A_k`` holds none above it and receives the keys up to
``q`` it lacks). With no rank receiving more than ``K``, ``A_1`` holds at least ``keys(L - 1) - K``
rows of the document and ``A_2 .. A_k`` at least ``keys(q) - K`` each; so the first ``k`` hold
rows ``[q, L)``, the rest of those rows at the least their cheapest first rows cost, and fill up to
``kF`` tokens with the cheapest rows of the layout, within ``k`` caps. If no ``q`` fits, the
document lies on fewer than ``k`` ranks; if fewer cannot hold it, no such plan exists::

    causal, 3 ranks, 12 tokens and 6 of 1 token (F = 6, cap 28.3): could no rank receive more
    than K = 6? Two ranks cannot hold the document's 78 pairs (2 caps: 56.6), so k = 2 must fit.
    A_1 holds at least 12 - 6 rows and A_2 at least q + 1 - 6. q <= 6: rows [6, 12) alone cost
    57. q = 7: rows [7, 12) cost 50, 3 more rows (the first: 6) and 4 fill rows (4), 60; q = 8:
    42 + 15 + 3; higher q cost more. So some rank receives 7 (the third figure gives 6; the
    balanced planner's plan receives 8).

A fifth figure weighs the heaviest documents together, where they compete for the same cheap
fill. With no rank receiving more than ``K``, the holder ``A_d`` of document ``d``'s last row holds
at least ``n_d = keys(L_d - 1) - K`` of its rows: its last ``s`` rows and ``n_d - s`` below them
(``s >= n_d - K``, as in the third figure), at least the least ``own_d`` of those. Where two such
documents cannot share a rank (their ``own`` and the cheapest fill exceed one cap, or their rows one
rank's tokens), their holders are distinct ranks: ``h`` of them hold at least ``hF - sum(n_d)`` more
rows, all different rows, within ``h`` caps. At most ``NK`` of those are *single* rows (each is
received by another rank, at most ``K`` per rank); the rest are rows of other documents at no less
than their mean (third figure), or the ``L_d - n_d`` rows of a heavy document that its own holder
lacks, at no less than the document's cheapest ``L_d - n_d`` rows (counting all ``L_d`` would count its
first rows twice: in ``own_d`` and as fill; lognormal layout #5 of the plan benchmark over 8 ranks:
32 keys counting them twice, 62 not)::

    causal, 3 ranks, 22, 22 and five 3-token documents (F = 19, cap 1.01 * 536 / 3 = 180.45):
    could no rank receive more than K = 7? Each long document's holder holds its last 8 rows and
    its first 7 (176, the least of any 15 rows it may hold), and 4 more rows: 176 + 4 fits one cap.
    Two such documents cannot share a rank (352), and their holders' 8 more rows cost at least 9
    (only 7 rows of the layout cost 1): 361 > 2 caps. So some rank receives 8 (the other figures
    give 7).

Allowing more keys does not always make this figure easier to meet (which documents weigh in
changes with ``K``), so it is bisected upward from the other figures' bound: each ``K`` it rules
out proves the bound above it, and a ``K`` it misses only leaves the bound lower.

The bound is the largest of these figures over all documents (0 when every document may stay
whole next to the cheapest fill). Only the mask protocol is used (``pairs`` for the work,
``row_costs`` for the rows), so it holds for every mask; the other four figures only where
every row sees its document from key 0 and costs never fall along the document (causal, full).
It is exact for one document much longer than a rank and 0 when only the packing of many short
documents forces cuts (where :mod:`bench.plan` reports no ratio). Host cost: O(tokens + distinct
lengths x longest document x log T), a benchmark tool, not part of planning.

:func:`causal_floor` is the part the planner uses: the first two figures of the longest document
under a causal mask, with every row of fill at the least a row costs (1, a document's first row),
in closed form: O(log L) arithmetic, no table of rows. A plan within a hair of it leaves nothing
worth searching for (:data:`doccp.plan.balanced.BOUND_SLACK`)::

    one document of 800 tokens and 224 of 1 token over 8 ranks (128 tokens each, cap 40.5k pairs):
    the holder of row 799 holds at most 128 rows (row 799 and the first 127 cost 800 + 8128), so
    it receives at least 800 - 128 = 672 keys
"""

from __future__ import annotations

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask

#: The work cap a balanced plan allows (max/mean).
TOLERANCE = 1.01
#: Parts the third figure cuts a range of ``j`` into where the range as a whole fits the cap
#: (:meth:`_Figures._fits_within`): each round rules out the parts that do not fit.
J_PARTS = 4
#: Most ranges :meth:`_Figures._fits_within` keeps refining at once.
MAX_RANGES = 1 << 20
#: Most holders of a document's top rows the fourth figure counts (checking fewer never overstates
#: the bound): on the benchmark's layouts it rules plans out with 2-4 of them, and each more is one
#: pass over the document's rows per step of the bisection.
CHAIN_HOLDERS = 8
#: Most documents the fifth figure weighs together, heaviest first (weighing fewer never overstates
#: the bound): each is checked against every one kept before it.
TOGETHER = 64


class _Pool:
    """Rows in groups of rising cost (``cost[g]`` per row of group ``g``, ``counts[g]`` rows): the
    least work of any ``t`` of them, for many ``t`` at once."""

    def __init__(self, cost: torch.Tensor, counts: torch.Tensor, indexed: bool = False):
        self.cost = cost.double()
        self.rows = torch.cumsum(counts.double(), 0)
        self.work = torch.cumsum(self.cost * counts, 0)
        # indexed: every row's cost, cheapest first (one gather per :meth:`row_cost`, no search)
        self.nth = torch.repeat_interleave(self.cost, counts.long()) if indexed else None

    @classmethod
    def of_histogram(cls, counts: torch.Tensor, indexed: bool = False) -> _Pool:
        """Rows by cost, ``counts[c]`` rows of cost ``c`` (costs are at most the longest document,
        so no sort of every row)."""
        return cls(torch.arange(counts.numel()), counts, indexed)

    @property
    def size(self) -> int:
        return int(self.rows[-1]) if self.rows.numel() else 0

    def row_cost(self, k: torch.Tensor) -> torch.Tensor:
        """Cost of the ``k``-th cheapest row (``1 <= k <= size``)."""
        if self.nth is not None:
            return self.nth[k.clamp(max=self.nth.numel()) - 1]
        return self.cost[torch.searchsorted(self.rows, k.double()).clamp(max=self.cost.numel() - 1)]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Least work of ``t`` rows; infinite where there are fewer."""
        if self.rows.numel() == 0:
            return torch.where(t <= 0, 0.0, torch.inf)
        t = t.double()
        g = torch.searchsorted(self.rows, t).clamp(max=self.rows.numel() - 1)
        before = (g - 1).clamp(min=0)
        rows_before = torch.where(g > 0, self.rows[before], 0.0)
        work_before = torch.where(g > 0, self.work[before], 0.0)
        return torch.where(t <= self.rows[-1], work_before + (t - rows_before) * self.cost[g], torch.inf)


def _mixed(single: _Pool, means: _Pool, t: torch.Tensor, most: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """Least work of ``t`` rows, at most ``most`` of them from ``single`` and the rest from
    ``means`` (third figure); never below ``single(t)``, infinite where no mix makes ``t`` rows.
    ``exact=False``: the better of the two extreme mixes, never below the least (a quick check)."""
    lo = (t - means.size).clamp(min=0)
    hi = torch.minimum(torch.minimum(t, most), torch.full_like(t, single.size))
    possible = lo <= hi
    hi = torch.maximum(lo, hi)
    if exact:
        # Convex in the number c of single rows: the best c is the first whose next single row
        # costs no less than the mean row it replaces.
        while bool((lo < hi).any()):
            mid = (lo + hi) // 2
            stop, active = single.row_cost(mid + 1) >= means.row_cost(t - mid), lo < hi
            lo, hi = torch.where(active & ~stop, mid + 1, lo), torch.where(active & stop, mid, hi)
    work = torch.minimum(single(lo) + means(t - lo), single(hi) + means(t - hi))
    return torch.where(possible, torch.maximum(work, single(t)), torch.inf)


def kv_lower_bound(layout: DocLayout, world_size: int, mask: Mask, tolerance: float = TOLERANCE) -> int:
    """KV tokens the most-loaded rank receives in any plan with tokens per rank within one and
    work max/mean <= ``tolerance`` (a lower bound; see the module docstring)."""
    if world_size == 1 or layout.num_tokens == 0:
        return 0
    figures = _Figures(layout, world_size, mask, tolerance)
    bound = figures.largest()
    if figures.prefix_masked:  # third and fourth figures: the least K every document allows; then the fifth
        most = min(figures.total - figures.floor_tokens, figures.longest_top)
        bound = _bisect(figures.allow, bound, most)
        bound = _bisect(figures.together, bound, most)
    return bound


def causal_floor(layout: DocLayout, world_size: int, tolerance: float = TOLERANCE) -> int:
    """A lower bound on the KV the most-loaded rank receives under a causal mask, in O(log L): the
    first and second figures of the longest document (length ``L``), every row of fill costing 1
    (no more than the cheapest row of any document, so the bound stays below theirs). The holder of
    row ``L - 1`` holds at most the ``n`` rows whose least work (that row, the first ``n - 1``, and
    fill up to a rank's tokens) fits the cap, and receives ``L - n``; of the ``m`` last rows it may
    hold, it or the holder of row ``L - m - 1`` receives half of ``L - m``."""
    n, total = world_size, layout.num_tokens
    if n == 1 or total == 0:
        return 0
    lengths = layout.lengths
    length = int(lengths.max())
    floor_tokens, most = total // n, min(length, -(-total // n))
    cap = tolerance * int((lengths * (lengths + 1) // 2).sum()) / n

    def pairs(a: int, b: int) -> int:  # row i sees its i + 1 first keys
        return (b * (b + 1) - a * (a + 1)) // 2

    def largest(fits) -> int:  # the most rows in [1, most] that fit (fitting is a prefix)
        lo, hi = 1, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    first = largest(lambda k: length + pairs(0, k - 1) + max(floor_tokens - k, 0) <= cap)
    last = largest(lambda m: pairs(length - m, length) + max(floor_tokens - m, 0) <= cap)
    return max(length - first, (length - last + 1) // 2)


def _bisect(allowed, lo: int, hi: int) -> int:
    """The least ``K`` in ``[lo, hi]`` that ``allowed`` admits, where it is monotone; otherwise
    some ``K`` above the last it ruled out (each step up is a proof, so still a bound)."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if allowed(mid) else (mid + 1, hi)
    return lo


class _Figures:
    """The figures of the module docstring for the documents of one layout."""

    def __init__(self, layout: DocLayout, world_size: int, mask: Mask, tolerance: float):
        lengths = layout.lengths
        self.world_size, self.mask, self.total = world_size, mask, layout.num_tokens
        self.floor_tokens, self.cap_tokens = self.total // world_size, -(-self.total // world_size)
        self.cap_work = tolerance * float(mask.row_work(0, lengths, lengths).sum()) / world_size
        self.distinct, self.copies = torch.unique(lengths[lengths > 0], return_counts=True)
        self.width = int(self.distinct.max()) + 1  # no row sees more keys than its document has
        self.costs = {length: mask.row_costs(length) for length in self.distinct.tolist()}
        self.everyone = torch.zeros(self.width, dtype=torch.float64)
        for length, k in zip(self.distinct.tolist(), self.copies.tolist(), strict=True):
            self.everyone += k * torch.bincount(self.costs[length], minlength=self.width)
        self.every_row = _Pool.of_histogram(self.everyone, indexed=True)  # (the fourth figure's)
        mean = mask.row_work(0, self.distinct, self.distinct).double() / self.distinct
        self.by_mean = torch.argsort(mean)
        self.mean = mean[self.by_mean]
        self.longest_top = int(self.costs[int(self.distinct[-1])][-1])  # every K above it is allowed
        self._holders: dict[int, int] = {}
        self._splits: dict[int, torch.Tensor] = {}
        self.prefix_masked = all(_rows_see_from_zero(mask, length) and bool((c[1:] >= c[:-1]).all())
                                 for length, c in self.costs.items())

    def _longest_first(self):
        return reversed(list(enumerate(self.distinct.tolist())))

    def largest(self) -> int:
        """The largest first or second figure over the documents."""
        bound = 0
        for _, length in self._longest_first():
            if length - 1 <= bound:  # no figure exceeds length - 1
                break
            costs = self.costs[length]
            others = _Pool.of_histogram(self.everyone - torch.bincount(costs, minlength=self.width))
            bound = max(bound, _holder_of_the_top_row(costs, others, self.floor_tokens, self.cap_tokens,
                                                      self.cap_work))
            if _rows_see_from_zero(self.mask, length):
                bound = max(bound, _two_ranks(costs, self.every_row, self.floor_tokens, self.cap_tokens,
                                              self.cap_work))
        return bound

    def _fits_within(self, lo: torch.Tensor, hi: torch.Tensor, s: torch.Tensor, last: torch.Tensor,
                     first: torch.Tensor, rest: torch.Tensor, budget: int, single: _Pool, means: _Pool,
                     exact: bool) -> bool:
        """Whether, for some ``s``, holding the last ``s`` rows and ``j`` in ``[lo, hi]`` first rows
        of a document plus the fill fits the cap. A range ``[a, b]`` of ``j`` is charged its least
        first rows, ``first[a]``, and its least fill, that of ``j = b``: a lower bound for every
        ``j`` in it, so a range that does not fit is ruled out, and one that does is cut into
        :data:`J_PARTS` parts and tried again, down to single ``j`` (each evaluated exactly)."""
        row = torch.arange(s.numel())
        a, b = lo, hi
        while True:
            keep = (a <= b) & (s[row] + a <= self.cap_tokens)
            row, a, b = row[keep], a[keep], b[keep]
            fill = _mixed(single, means, (rest[row] - b).clamp(min=0), budget - a, exact)
            fits = last[row] + first[a] + fill <= self.cap_work
            if not bool(fits.any()):
                return False
            if bool((fits & (a == b)).any()) or int(fits.sum()) * J_PARTS > MAX_RANGES:
                return True  # (too many ranges left to try: claiming a fit never overstates the bound)
            row, a, b = row[fits], a[fits], b[fits]
            # each range that fits, in J_PARTS parts (a range of one j stays as it is)
            edges = a[:, None] + (torch.arange(J_PARTS + 1) * (b - a + 1)[:, None]) // J_PARTS
            row = row[:, None].expand(-1, J_PARTS).reshape(-1)
            a, b = edges[:, :-1].reshape(-1), edges[:, 1:].reshape(-1) - 1

    def allow(self, keys: int) -> bool:
        """Whether every document's last row fits some rank, and the holders of its top rows fit
        theirs, in a plan where no rank receives more than ``keys`` keys (third and fourth figures);
        ``False`` proves that every balanced plan receives more. Monotone in ``keys`` (every
        option only gets cheaper as it grows: the fourth figure charges the least work of any
        number of rows under ``q`` from the fewest the holders need on), so
        :func:`kv_lower_bound` bisects it."""
        budget = (self.world_size - 1) * keys
        for index, length in self._longest_first():
            costs = self.costs[length]
            top = int(costs[-1])
            if top <= keys:
                continue
            # A holds the last s rows and j >= below rows under them, j <= keys (module docstring)
            fewest, most = max(1, top - 2 * keys), min(length, self.cap_tokens)
            if fewest > most:  # A cannot hold enough of the document
                return False
            s = torch.arange(fewest, most + 1)
            below = (top - keys - s).clamp(min=0)
            last = torch.cumsum(costs.flip(0).double(), 0)[s - 1]
            first = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(costs.double(), 0)])
            single = _Pool.of_histogram(self.everyone - torch.bincount(costs, minlength=self.width))
            rows = self.distinct * self.copies
            rows[index] -= length
            means = _Pool(self.mean, rows[self.by_mean])
            rest = self.floor_tokens - s
            # j = below exactly, or any j in [below + 1, min(keys, length - s)]: only the length - s
            # rows under the last s exist to be held. The extreme mixes first, most documents fit
            # with one of them
            lo, hi = below + 1, (length - s).clamp(max=keys)
            for exact in (False, True):
                least = first[below] + _mixed(single, means, (rest - below).clamp(min=0), budget - below, exact)
                if bool(((last + least <= self.cap_work) & (s + below <= self.cap_tokens)).any()):
                    break
                if self._fits_within(lo, hi, s, last, first, rest, budget, single, means, exact):
                    break
            else:
                return False
            if not self._chain_allows(length, keys):
                return False
        return True

    def together(self, keys: int) -> bool:
        """Whether the holders of the heaviest documents' last rows fit their caps together in a
        plan where no rank receives more than ``keys`` keys (fifth figure, module docstring);
        ``False`` proves that every balanced plan receives more."""
        heavy = self._apart(self._least_held(keys))
        if len(heavy) < 2:
            return True
        own = torch.cumsum(torch.tensor([w for w, _, _ in heavy], dtype=torch.float64), 0)
        rows = torch.cumsum(torch.tensor([n for _, n, _ in heavy]), 0)
        h = torch.arange(1, len(heavy) + 1)
        single = torch.minimum(h * (self.world_size - 1), torch.full_like(h, self.world_size)) * keys
        fill = _mixed(self.every_row, self._rest_of(heavy), (h * self.floor_tokens - rows).clamp(min=0), single)
        return not bool((own + fill > h * self.cap_work).any())

    def _least_held(self, keys: int) -> list[tuple[float, int, int]]:
        """``(own, n, index)`` per document whose last row sees more than ``keys`` keys: the
        least ``n`` of its rows the holder of that row holds, and their least work (fifth figure)."""
        held = []
        for index, length in self._longest_first():
            costs = self.costs[length].double()
            top = int(costs[-1])
            if top <= keys:
                break  # (the last row sees no fewer keys in a longer document)
            rows = top - keys  # its last s rows and rows - s <= keys below them
            s = torch.arange(max(1, top - 2 * keys), min(rows, length) + 1)
            if s.numel() == 0 or rows > self.cap_tokens:
                continue  # (the third figure rules this K out)
            last = torch.cumsum(costs.flip(0), 0)[s - 1]
            first = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(costs, 0)])[rows - s]
            held += [(float((last + first).min()), rows, index)] * int(self.copies[index])
        return held

    def _apart(self, held: list[tuple[float, int, int]]) -> list[tuple[float, int, int]]:
        """The heaviest of ``held`` (up to :data:`TOGETHER`), each kept if it can share a rank with
        none kept before it: its least rows and another's, and the cheapest fill, exceed one rank's
        tokens or work."""
        kept: list[tuple[float, int, int]] = []
        for own, rows, index in sorted(held, key=lambda item: -item[0])[:TOGETHER]:
            if kept:
                other = torch.tensor([w for w, _, _ in kept], dtype=torch.float64)
                both = rows + torch.tensor([n for _, n, _ in kept])
                fill = self.every_row((self.floor_tokens - both).clamp(min=0))
                if not bool(((both > self.cap_tokens) | (own + other + fill > self.cap_work)).all()):
                    continue
            kept.append((own, rows, index))
        return kept

    def _rest_of(self, heavy: list[tuple[float, int, int]]) -> _Pool:
        """Rows the holders of ``heavy`` fill up with besides single rows: every other document's
        at its mean, and of each heavy document only the rows its own holder lacks (fifth figure).
        Its holder holds at least ``n`` of its rows, at least ``own`` of work, whichever they are;
        the other ``L - n`` may fill another holder, at no less than the document's cheapest
        ``L - n`` rows (costs never fall along it). Its other rows are its holder's already."""
        copies = torch.bincount(torch.tensor([index for _, _, index in heavy]),
                                minlength=self.distinct.numel()).double()
        own = torch.zeros(self.width, dtype=torch.float64)
        for _, rows, index in heavy:
            length = int(self.distinct[index])
            own += torch.bincount(self.costs[length][:length - rows], minlength=self.width)
        cost = torch.cat([self.mean, torch.arange(self.width, dtype=torch.float64)])
        counts = torch.cat([((self.copies - copies) * self.distinct)[self.by_mean], own])
        order = torch.argsort(cost, stable=True)
        return _Pool(cost[order], counts[order])

    def _fewest_holders(self, length: int) -> int:
        """The fewest ranks that can hold all of a document of ``length`` tokens, each filled up
        to the floor with the cheapest rows of the layout (fourth figure); cached per length."""
        if length not in self._holders:
            work = float(self.costs[length].double().sum())
            c = torch.arange(1, self.world_size + 1)
            fits = (length <= c * self.cap_tokens) & (
                work + self.every_row((c * self.floor_tokens - length).clamp(min=0)) <= c * self.cap_work)
            self._holders[length] = int(c[fits][0]) if bool(fits.any()) else self.world_size + 1
        return self._holders[length]

    def _chain_allows(self, length: int, keys: int) -> bool:
        """Whether the first ``k`` holders of a document's top rows fit the cap together, for every
        ``k`` up to the fewest ranks that can hold all of it, in a plan where no rank receives more
        than ``keys`` keys (fourth figure, module docstring)."""
        holders = min(self._fewest_holders(length), self.world_size, CHAIN_HOLDERS)
        if holders < 2:
            return True
        costs = self.costs[length].double()
        suffix = torch.cumsum(costs.flip(0), 0).flip(0)[:-1]  # work of rows [q, L), q <= L - 2
        first = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(costs, 0)])
        top = max(int(self.costs[length][-1]) - keys, 0)  # rows the top row's holder holds at least
        split = self._cheapest_split(length)
        for k in range(2, holders + 1):
            # q, the highest row the first k - 1 holders lack: rows [q, L) are the k holders', and
            # no fewer than L - q of them fit the k ranks' tokens and work
            least = max(length - k * self.cap_tokens, int(torch.searchsorted(-suffix, -k * self.cap_work)))
            q = torch.arange(least, length - 1)
            above = length - q
            rows = top + (k - 1) * (self.costs[length][least:-1] - keys).clamp(min=0)
            fill = k * self.floor_tokens - above  # rows the k ranks hold besides rows [q, L)
            # j rows under q (their first j at least), j from the least the holders need to the most
            # they can hold, and fill - j rows of the layout: the least work of any such j
            need = torch.maximum((rows - above).clamp(min=0), fill - self.every_row.size)
            most = torch.minimum(q, k * self.cap_tokens - above)
            j = torch.maximum(torch.minimum(split[fill.clamp(0, self.total)], most), need)
            work = suffix[least:] + first[j.clamp(max=length)] + self.every_row((fill - j).clamp(min=0))
            if not bool(((need <= most) & (work <= k * self.cap_work)).any()):
                return False  # no k holders fit, and fewer than k cannot hold all of it
        return True

    def _cheapest_split(self, length: int) -> torch.Tensor:
        """For every ``t`` up to the layout's tokens, the ``j`` for which the first ``j`` rows of a
        document of ``length`` tokens plus the cheapest ``t - j`` rows of the layout cost least;
        cached per length. Convex in ``j``: the first ``j`` whose next row of the document costs no
        less than the layout's row it replaces, so the least over a range of ``j`` is at this ``j``
        clamped into the range."""
        if length not in self._splits:
            costs = self.costs[length].double()
            t = torch.arange(self.total + 1)
            lo, hi = torch.zeros_like(t), t.clamp(max=length - 1)
            while bool((lo < hi).any()):
                mid = (lo + hi) // 2
                left = t - mid
                replaced = torch.where(left >= 1, self.every_row.row_cost(left.clamp(min=1)), 0.0)
                stop, active = costs[mid] >= replaced, lo < hi
                lo, hi = torch.where(active & ~stop, mid + 1, lo), torch.where(active & stop, mid, hi)
            self._splits[length] = lo
        return self._splits[length]


def _holder_of_the_top_row(costs: torch.Tensor, fill: _Pool, floor_tokens: int, cap_tokens: int,
                           cap_work: float) -> int:
    """``keys(p) - n`` (module docstring, first figure); ``fill``: the other documents' rows."""
    length = costs.numel()
    p = int(torch.argmax(costs))
    keys = int(costs[p])
    others = torch.cat([costs[:p], costs[p + 1:]]).sort().values.double()
    n = torch.arange(1, min(length, cap_tokens) + 1)
    own = keys + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(others, 0)])[: n.numel()]
    fits = own + fill((floor_tokens - n).clamp(min=0)) <= cap_work
    most = int(n[fits].max()) if bool(fits.any()) else 1  # none fits: no plan is balanced at all
    return max(keys - most, 0)


def _two_ranks(costs: torch.Tensor, fill: _Pool, floor_tokens: int, cap_tokens: int, cap_work: float) -> int:
    """``ceil((L - m) / 2)``, ``m`` the most last rows one rank can hold (module docstring, second
    figure); ``fill``: every row of the layout (the document's earlier rows among them)."""
    length = costs.numel()
    m = torch.arange(1, min(length, cap_tokens) + 1)
    last = torch.cumsum(costs.flip(0).double(), 0)[: m.numel()]
    fits = last + fill((floor_tokens - m).clamp(min=0)) <= cap_work
    most = int(m[fits].max()) if bool(fits.any()) else 1
    return (length - most + 1) // 2


def _rows_see_from_zero(mask: Mask, length: int) -> bool:
    """Every row of a document of ``length`` tokens sees keys ``[0, row]`` (and maybe more)."""
    rows = torch.arange(length)
    lo, hi = mask.visible_keys(rows, rows + 1, length)
    return bool(((torch.as_tensor(lo) == 0) & (torch.as_tensor(hi) > rows)).all())
