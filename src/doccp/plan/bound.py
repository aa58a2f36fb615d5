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

The bound is the largest such figure over all documents (0 when every document may stay whole
next to the cheapest fill). Only the mask protocol is used (``pairs`` for the work,
``row_costs`` for the rows), so it holds for every mask. It is exact for one document much
longer than a rank and 0 when only the packing of many short documents forces cuts (where
:mod:`bench.plan` reports no ratio). Host cost: O(tokens + distinct lengths x longest
document), a benchmark tool, not part of planning.
"""

from __future__ import annotations

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask

#: The work cap a balanced plan allows (max/mean).
TOLERANCE = 1.01


class _Fill:
    """The least work of ``t`` rows drawn from a pool of rows, for many ``t`` at once: the pool as
    a histogram of row costs (costs are at most the longest document, so no sort of every row)."""

    def __init__(self, counts: torch.Tensor):
        cost = torch.arange(counts.numel(), dtype=torch.float64)
        self.rows = torch.cumsum(counts, 0)  # rows of cost <= c
        self.work = torch.cumsum(counts * cost, 0)  # their work

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Least work of ``t`` rows of the pool; infinite where the pool has fewer rows."""
        t = t.double()
        c = torch.searchsorted(self.rows, t).clamp(max=self.rows.numel() - 1)
        below = (c - 1).clamp(min=0)
        rows_below = torch.where(c > 0, self.rows[below], 0.0)
        work_below = torch.where(c > 0, self.work[below], 0.0)
        least = work_below + (t - rows_below) * c.double()
        return torch.where(t <= self.rows[-1], least, torch.inf)


def kv_lower_bound(layout: DocLayout, world_size: int, mask: Mask, tolerance: float = TOLERANCE) -> int:
    """KV tokens the most-loaded rank receives in any plan with tokens per rank within one and
    work max/mean <= ``tolerance`` (a lower bound; see the module docstring)."""
    lengths = layout.lengths
    if world_size == 1 or layout.num_tokens == 0:
        return 0
    total = layout.num_tokens
    floor_tokens, cap_tokens = total // world_size, -(-total // world_size)
    cap_work = tolerance * float(mask.pairs(0, lengths, 0, lengths).sum()) / world_size
    distinct, copies = torch.unique(lengths[lengths > 0], return_counts=True)
    width = int(distinct.max()) + 1  # no row sees more keys than its document has
    everyone = torch.zeros(width, dtype=torch.float64)
    for length, k in zip(distinct.tolist(), copies.tolist(), strict=True):
        everyone += k * torch.bincount(mask.row_costs(length), minlength=width)
    bound = 0
    for length in reversed(distinct.tolist()):  # longest first: no figure exceeds length - 1
        if length - 1 <= bound:
            break
        costs = mask.row_costs(length)
        others = _Fill(everyone - torch.bincount(costs, minlength=width))
        bound = max(bound, _holder_of_the_top_row(costs, others, floor_tokens, cap_tokens, cap_work))
        if _rows_see_from_zero(mask, length):
            bound = max(bound, _two_ranks(costs, _Fill(everyone), floor_tokens, cap_tokens, cap_work))
    return bound


def _holder_of_the_top_row(costs: torch.Tensor, fill: _Fill, floor_tokens: int, cap_tokens: int,
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


def _two_ranks(costs: torch.Tensor, fill: _Fill, floor_tokens: int, cap_tokens: int, cap_work: float) -> int:
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
