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

from functools import cached_property

import torch

from doccp.kernels.runs import Runs
from doccp.plan import Plan
from doccp.plan.exchange import visible_intervals
from doccp.plan.pieces import Pieces
from doccp.ranges import expand, starts, take


def local_runs(plan: Plan, rank: int) -> Runs:
    """The rank's local tokens as stride-1 runs, one per piece, in local row order."""
    p = plan.rank_pieces(rank)
    return Runs.laid_out(p.doc, p.start, p.length, rank=rank)


class Geometry:
    """Stream offsets of a plan's pieces and one rank's view of them (shared by the schedules;
    each schedule reads only what it needs, so the plan-wide parts are computed on first use)."""

    def __init__(self, plan: Plan, me: int):
        self.plan = plan
        self.local = p = plan.rank_pieces(me)
        self.local_base = take(plan.layout.cu_seqlens, p.doc)  # stream offset of each piece's document
        self.local_g0, self.local_g1 = self.local_base + p.start, self.local_base + p.end
        self.local_row = starts(p.length)
        self.runs = Runs.laid_out(p.doc, p.start, p.length, rank=me)

    @cached_property
    def seen(self) -> Pieces:
        """The key intervals my queries see, merged per document."""
        return visible_intervals(self.local, self.plan.layout.lengths, self.plan.mask)

    @cached_property
    def seen_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Stream offsets ``[g0, g1)`` of :attr:`seen`."""
        base = take(self.plan.layout.cu_seqlens, self.seen.doc)
        return base + self.seen.start, base + self.seen.end

    def visible_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Stream offsets of the keys each local piece sees (its hull under the mask)."""
        p = self.local
        lo, hi = self.plan.mask.visible_keys(p.start, p.end, take(self.plan.layout.lengths, p.doc))
        return self.local_base + lo, self.local_base + hi

    def local_rows(self, g0: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Local rows of the stream ranges ``[g0, g0 + length)`` (all held by this rank)."""
        piece = torch.searchsorted(self.local_g0, g0, right=True) - 1
        return expand(take(self.local_row, piece) + (g0 - take(self.local_g0, piece)), length)
