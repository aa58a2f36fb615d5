"""Host-side schedules: who sends which KV rows where, and the slices each step computes.

Computed once per (plan, rank, algorithm) from the plan alone (every rank can compute every
other rank's sizes, so no size handshakes are needed) and cached for the plan's lifetime.
A *segment* is a run of buffer rows holding consecutive positions of one document:
``(doc, row, pos, length)``. Buffers are described by segments, and :func:`pair_slices`
turns (query segments, key segments) into kernel slices, for every algorithm alike.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from doccp.kernels.slices import Slices, pair_slices
from doccp.layout import expand_ranges, repeat_interleave
from doccp.plan import Plan
from doccp.plan.exchange import visible_intervals
from doccp.plan.pieces import Pieces


@dataclass(frozen=True)
class Segments:
    doc: torch.Tensor
    row: torch.Tensor
    pos: torch.Tensor
    length: torch.Tensor

    @classmethod
    def packed(cls, doc: torch.Tensor, pos: torch.Tensor, length: torch.Tensor, row0: int = 0) -> Segments:
        """Segments laid out back to back from buffer row ``row0``."""
        return cls(doc, row0 + torch.cumsum(length, 0) - length, pos, length)

    @classmethod
    def cat(cls, parts: list[Segments]) -> Segments:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("doc", "row", "pos", "length")))

    @property
    def rows(self) -> int:
        return int((self.row + self.length).max()) if self.doc.numel() else 0

    def locate(self, doc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Buffer row holding each ``(doc, pos)``; every position must be in some segment."""
        big = int(torch.cat([self.pos + self.length, pos]).max()) + 1
        key = self.doc * big + self.pos
        order = torch.argsort(key)
        i = order[torch.searchsorted(key[order], doc * big + pos, right=True) - 1]
        return self.row[i] + (pos - self.pos[i])

    def expand(self, doc: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Buffer rows of the document ranges ``[start, end)``, concatenated in order."""
        length = end - start
        return self.locate(repeat_interleave(doc, length), expand_ranges(start, length))

    def slices_against(self, keys: Segments, plan: Plan) -> Slices:
        return pair_slices(self.doc, self.row, self.pos, self.length,
                           keys.doc, keys.row, keys.pos, keys.length, plan.mask)


def local_segments(plan: Plan, rank: int) -> Segments:
    p = plan.rank_pieces(rank)
    return Segments.packed(p.doc, p.start, p.length)


@dataclass(frozen=True)
class AllGatherSchedule:
    """Selective all-gather: exchange exactly the minimal KV, arrange it in document order."""

    send_rows: list[torch.Tensor]  # local rows to send to each peer
    recv_sizes: list[int]  # rows received from each peer
    arrange: torch.Tensor  # rows of cat(local, received...) forming the arranged buffer
    slices: Slices  # local queries vs arranged buffer: one slice per local piece


@dataclass(frozen=True)
class RingSchedule:
    """Ring pass-KV: every rank's block (its rows some other rank needs) visits every rank."""

    own_block_rows: torch.Tensor  # local rows forming this rank's block
    block_sizes: list[int]  # block rows of every rank
    step_slices: list[Slices]  # step t: local queries vs the block of rank (me - t) % N


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def schedule(plan: Plan, rank: int, algorithm: str) -> AllGatherSchedule | RingSchedule:
    per_plan = _cache.setdefault(plan, {})
    key = (algorithm, rank)
    if key not in per_plan:
        per_plan[key] = {"allgather": _allgather, "ring_kv": _ring}[algorithm](plan, rank)
    return per_plan[key]


def _allgather(plan: Plan, me: int) -> AllGatherSchedule:
    ex, n = plan.exchange, plan.world_size
    local = local_segments(plan, me)
    send_rows, recv_sizes, parts = [], [], [local]
    row = local.rows
    for peer in range(n):
        out = ex.select((ex.src == me) & (ex.dst == peer))
        send_rows.append(local.expand(out.doc, out.start, out.end))
        inc = ex.select((ex.dst == me) & (ex.src == peer))
        recv_sizes.append(int(inc.length.sum()))
        parts.append(Segments.packed(inc.doc, inc.start, inc.length, row0=row))
        row += recv_sizes[-1]
    gathered = Segments.cat(parts)
    seen = visible_intervals(plan.rank_pieces(me), plan.layout.lengths, plan.mask)
    arranged = Segments.packed(seen.doc, seen.start, seen.length)
    return AllGatherSchedule(send_rows, recv_sizes, gathered.expand(seen.doc, seen.start, seen.end),
                             local.slices_against(arranged, plan))


def block_intervals(plan: Plan, src: int) -> Pieces:
    """Rows of ``src`` that some other rank needs, merged, as (src, doc, start, end)."""
    ex = plan.exchange
    sel = ex.select(ex.src == src)
    return Pieces(sel.src, sel.doc, sel.start, sel.end).normalized_union()


def _ring(plan: Plan, me: int) -> RingSchedule:
    n = plan.world_size
    local = local_segments(plan, me)
    blocks = [block_intervals(plan, s) for s in range(n)]
    own = blocks[me]
    steps = [local.slices_against(local, plan)]
    for t in range(1, n):
        b = blocks[(me - t) % n]
        steps.append(local.slices_against(Segments.packed(b.doc, b.start, b.length), plan))
    return RingSchedule(local.expand(own.doc, own.start, own.end),
                        [int(b.length.sum()) for b in blocks], steps)
