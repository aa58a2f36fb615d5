"""A lower bound on the KV the most-loaded rank must receive, for any balanced plan.

Any plan that keeps tokens per rank within one and work max/mean <= 1.01 must cut every
document with more tokens than a rank holds or more work than a rank may do. Take the query
row ``p`` of such a document that sees the most keys: the rank holding it holds at most ``n``
tokens of the document, where ``n`` is capped by the rank's tokens and by its work (row ``p``
plus the ``n - 1`` cheapest other rows must fit under the cap), so it receives at least
``keys(p) - n`` of the keys row ``p`` sees::

    causal, L = 10, a rank may do at most 30 pairs: row 9 costs 10, the cheapest others
    cost 1, 2, 3, 4, 5 (15 pairs), a sixth would exceed 30, so n <= 6 and the holder of
    row 9 receives at least 10 - 6 = 4 keys.

Where every row sees its document from key 0 up to itself (causal, full), a second figure holds
too: let ``m`` rows at the document's end be all on row ``L - 1``'s rank A (they are, up to the
highest row ``p`` another rank B holds). A receives every key it does not hold, ``L - n``; B
receives the keys up to ``p`` that A holds, at least ``n - m``; so the worse of the two receives
at least ``(L - m) / 2``, and ``m`` is capped by the work of the document's last rows on one rank::

    causal, 2 ranks, a document of 100 tokens and 100 of 1 token; a rank may do 2600 pairs:
    the last 30 rows cost 2565, 31 would cost 2635, so m <= 30 and some rank receives at least
    (100 - 30) / 2 = 35 keys (the first figure gives 100 - 71 = 29; the balanced planner's
    head + tail plan receives 41).

The bound is the largest such figure over all documents (0 when every document may stay
whole). Only the mask protocol is used (``pairs`` for the work, ``row_costs`` for the rows),
so it holds for every mask. It is exact for one document much longer than a rank and 0 when
only the packing of many short documents forces cuts (where no bound is computed:
:mod:`bench.plan` reports the ratio only where the bound is positive). Host cost: O(tokens
of the documents that must be cut), a benchmark tool, not part of planning.
"""

from __future__ import annotations

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask

#: The work cap a balanced plan allows (max/mean).
TOLERANCE = 1.01


def kv_lower_bound(layout: DocLayout, world_size: int, mask: Mask, tolerance: float = TOLERANCE) -> int:
    """KV tokens the most-loaded rank receives in any plan with tokens per rank within one and
    work max/mean <= ``tolerance`` (a lower bound; see the module docstring)."""
    lengths = layout.lengths
    if world_size == 1 or layout.num_tokens == 0:
        return 0
    work = mask.pairs(0, lengths, 0, lengths)
    cap_tokens = -(-layout.num_tokens // world_size)
    cap_work = tolerance * float(work.sum()) / world_size
    cut = (lengths > cap_tokens) | (work.double() > cap_work)
    bound = 0
    for length in torch.unique(lengths[cut]).tolist():  # one per distinct length of a cut document
        costs = mask.row_costs(length)
        p = int(torch.argmax(costs))
        keys = int(costs[p])
        others = torch.cat([costs[:p], costs[p + 1:]]).sort().values
        cheapest = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(others, 0)])
        # largest n (tokens of the document on row p's rank) whose cheapest work fits the cap
        fits = int(torch.searchsorted(cheapest.double(), torch.tensor([cap_work - keys], dtype=torch.float64),
                                      right=True)) - 1
        n = max(1, min(fits + 1, cap_tokens, length))
        if keys + int(cheapest[0]) > cap_work:  # row p alone breaks the cap: no plan is balanced
            n = 1
        bound = max(bound, keys - n, _two_ranks(mask, costs, cap_work, cap_tokens))
    return bound


def _two_ranks(mask: Mask, costs: torch.Tensor, cap_work: float, cap_tokens: int) -> int:
    """``ceil((L - m) / 2)``, ``m`` the most last rows one rank can hold (module docstring), where
    every row sees its document from key 0 through itself; else 0."""
    length = costs.numel()
    rows = torch.arange(length)
    lo, hi = mask.visible_keys(rows, rows + 1, length)
    if not bool(((torch.as_tensor(lo) == 0) & (torch.as_tensor(hi) > rows)).all()):
        return 0
    last_rows = torch.cumsum(costs.flip(0), 0).double()  # work of the last 1, 2, ... rows
    m = min(int(torch.searchsorted(last_rows, torch.tensor([cap_work], dtype=torch.float64), right=True)),
            cap_tokens, length - 1)
    return (length - m + 1) // 2
