"""A lower bound on the KV the most-loaded rank must receive, for any balanced plan.

Any plan that keeps tokens per rank within one and work max/mean <= 1.01 must cut every
document with more tokens than a rank holds or more work than a rank may do. Take the query
row ``p`` of such a document that sees the most keys (the last row, for a causal mask): the
rank holding it holds at most ``n`` tokens of the document, where ``n`` is capped by the
rank's tokens and by its work (row ``p`` plus the ``n - 1`` cheapest other rows must fit
under the cap), so it receives at least ``keys(p) - n`` of the keys row ``p`` sees::

    causal, L = 10, a rank may do at most 30 pairs: row 9 costs 10, the cheapest others
    cost 1, 2, 3, 4, 5 (15 pairs), a sixth would exceed 30, so n <= 6 and the holder of
    row 9 receives at least 10 - 6 = 4 keys.

The bound is the largest such figure over all documents (0 when every document may stay
whole). It is exact for one document much longer than a rank and weak when only the
packing of many short documents forces cuts; :mod:`bench.plan` reports planner / bound.
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
    if not bool(cut.any()):
        return 0
    length = lengths[cut]
    # The row seeing the most keys: the last row of a causal band, the middle of a symmetric one.
    p = torch.clamp((length - 1 - mask.right_bound + mask.left_bound) // 2, min=0).minimum(length - 1)
    lo, hi = mask.visible_keys(p, p + 1, length)
    keys = hi - lo
    # Largest n whose cheapest work (row p + the n - 1 cheapest other rows) fits under the cap.
    lo_n, hi_n = torch.ones_like(length), torch.minimum(length - 1, torch.full_like(length, cap_tokens))
    while bool((lo_n < hi_n).any()):
        mid = (lo_n + hi_n + 1) // 2
        fits = (keys + _cheapest_rows(mid - 1, length, mask)).double() <= cap_work
        lo_n = torch.where(fits, mid, lo_n)
        hi_n = torch.where(fits, hi_n, mid - 1)
    return int((keys - lo_n).clamp(min=0).max())


def _cheapest_rows(k: torch.Tensor, length: torch.Tensor, mask: Mask) -> torch.Tensor:
    """A lower bound on the pairs of the ``k`` cheapest query rows of a document: exact for
    bands without look-ahead (row costs grow with the position, the first rows are the
    cheapest); otherwise ``k`` times the cheapest row."""
    if mask.right == 0:
        return mask.pairs(0, k, 0, length)
    lo, hi = mask.visible_keys(torch.zeros_like(length), torch.ones_like(length), length)
    last_lo, last_hi = mask.visible_keys(length - 1, length, length)
    return k * torch.minimum(hi - lo, last_hi - last_lo)
