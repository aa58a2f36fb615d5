"""Host-side geometry every schedule starts from: where a rank's pieces and visible keys sit.

A schedule (each algorithm's own, see :mod:`doccp.algorithms.registry`) is derived from the
plan alone, so every rank can compute every other rank's sizes and no size handshakes are
needed; it is computed once per (plan, rank, algorithm) and cached for the plan's lifetime.
Buffers are described by :class:`~doccp.kernels.runs.Runs` and
:meth:`~doccp.kernels.runs.Runs.slices_against` turns query runs and key runs into kernel
slices, for every algorithm alike.

Host cost: schedules are interval arithmetic over the plan's pieces in stream order (binary
searches, cumsums, stable sorts), O(pieces log pieces) plus the rows they list; no loop over
ranks or documents and no (receiver, sender) table.
"""

from __future__ import annotations

import torch

from doccp.kernels.runs import Runs
from doccp.plan import Plan
from doccp.plan.exchange import visible_intervals
from doccp.ranges import expand, take


def local_runs(plan: Plan, rank: int) -> Runs:
    """The rank's local tokens as stride-1 runs, one per piece, in local row order."""
    p = plan.rank_pieces(rank)
    return Runs.laid_out(p.doc, p.start, p.length, rank=rank)


class Geometry:
    """Stream offsets of a plan's pieces and one rank's view of them (shared by the schedules)."""

    def __init__(self, plan: Plan, me: int):
        cu = plan.layout.cu_seqlens
        self.stream = s = plan.stream_pieces
        base = take(cu, s.doc)
        self.g0, self.g1 = base + s.start, base + s.end
        self.local = p = plan.rank_pieces(me)
        base = take(cu, p.doc)
        self.local_g0, self.local_g1 = base + p.start, base + p.end
        self.local_row = torch.cumsum(p.length, 0) - p.length
        self.runs = Runs.laid_out(p.doc, p.start, p.length, rank=me)
        self.seen = visible_intervals(p, plan.layout.lengths, plan.mask)  # what my queries see
        base = take(cu, self.seen.doc)
        self.seen_g0, self.seen_g1 = base + self.seen.start, base + self.seen.end

    def local_rows(self, g0: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Local rows of the stream ranges ``[g0, g0 + length)`` (all held by this rank)."""
        piece = torch.searchsorted(self.local_g0, g0, right=True) - 1
        return expand(take(self.local_row, piece) + (g0 - take(self.local_g0, piece)), length)
