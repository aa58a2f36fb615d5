"""Host-side schedules: who sends which KV rows where, and the slices each step computes.

Computed once per (plan, rank, algorithm) from the plan alone (every rank can compute every
other rank's sizes, so no size handshakes are needed) and cached for the plan's lifetime.
A *segment* is a run of buffer rows holding consecutive positions of one document:
``(doc, row, pos, length)``. Buffers are described by segments, and :func:`pair_slices`
turns (query segments, key segments) into kernel slices, for every algorithm alike.

Host cost: a schedule is interval arithmetic over the plan's pieces in stream order
(binary searches, cumsums, one stable sort by rank), O(pieces log pieces) plus the rows it
lists; there is no loop over ranks or documents and no (receiver, sender) table.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from doccp.kernels.slices import Slices, pair_slices
from doccp.layout import expand_ranges, repeat_interleave
from doccp.plan import Plan
from doccp.plan.exchange import overlaps, visible_intervals
from doccp.plan.pieces import Pieces, offsets_within


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
    plan.check_rank(rank)
    per_plan = _cache.setdefault(plan, {})
    key = (algorithm, rank)
    if key not in per_plan:
        per_plan[key] = {"allgather": _allgather, "ring_kv": _ring}[algorithm](plan, rank)
    return per_plan[key]


class _Geometry:
    """Stream offsets of a plan's pieces and one rank's view of them (shared by both schedules)."""

    def __init__(self, plan: Plan, me: int):
        cu = plan.layout.cu_seqlens
        self.stream = s = plan.stream_pieces
        self.g0, self.g1 = cu[s.doc] + s.start, cu[s.doc] + s.end
        self.local = p = plan.rank_pieces(me)
        self.local_g0, self.local_g1 = cu[p.doc] + p.start, cu[p.doc] + p.end
        self.local_row = torch.cumsum(p.length, 0) - p.length
        self.seen = visible_intervals(p, plan.layout.lengths, plan.mask)  # what my queries see
        base = cu[self.seen.doc]
        self.seen_g0, self.seen_g1 = base + self.seen.start, base + self.seen.end

    def local_rows(self, g0: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Local rows of the stream ranges ``[g0, g0 + length)`` (all held by this rank)."""
        piece = torch.searchsorted(self.local_g0, g0, right=True) - 1
        return expand_ranges(self.local_row[piece] + (g0 - self.local_g0[piece]), length)


def _allgather(plan: Plan, me: int) -> AllGatherSchedule:
    n, geo = plan.world_size, _Geometry(plan, me)
    # Receive: my visible keys cut at the stream's pieces; the parts others hold arrive from
    # each peer in stream order, after my local rows.
    i, j, g0, g1 = overlaps(geo.seen_g0, geo.seen_g1, geo.g0, geo.g1)
    src, length = geo.stream.rank[j], g1 - g0
    remote = src != me
    recv_sizes = torch.zeros(n, dtype=torch.int64).index_add_(0, src[remote], length[remote])
    peer_base = int(geo.local.length.sum()) + torch.cumsum(recv_sizes, 0) - recv_sizes
    row = torch.empty_like(g0)
    row[remote] = peer_base[src[remote]] + offsets_within(src[remote], length[remote])
    own = ~remote
    piece = torch.searchsorted(geo.local_g0, g0[own], right=True) - 1
    row[own] = geo.local_row[piece] + (g0[own] - geo.local_g0[piece])
    arrange = expand_ranges(row, length)
    # Send: every other rank's visible keys cut at my pieces, ordered by (peer, doc, start).
    others = plan.seen.select(plan.seen.rank != me)
    base = plan.layout.cu_seqlens[others.doc]
    i, j, g0, g1 = overlaps(base + others.start, base + others.end, geo.local_g0, geo.local_g1)
    dst, length = others.rank[i], g1 - g0
    rows = expand_ranges(geo.local_row[j] + (g0 - geo.local_g0[j]), length)
    send_sizes = torch.zeros(n, dtype=torch.int64).index_add_(0, dst, length)
    send_rows = list(torch.split(rows, send_sizes.tolist()))
    local = Segments.packed(geo.local.doc, geo.local.start, geo.local.length)
    arranged = Segments.packed(geo.seen.doc, geo.seen.start, geo.seen.length)
    return AllGatherSchedule(send_rows, recv_sizes.tolist(), arrange, local.slices_against(arranged, plan))


def _blocks(plan: Plan) -> tuple[Pieces, torch.Tensor, torch.Tensor]:
    """Every rank's ring block in stream order, the row of each block interval within its
    rank's block, and every rank's block size (cached per plan).

    Key ``j`` of a piece ``[a, b)`` is needed by another rank iff a foreign query lies in
    ``[j - right, j + left]``; the nearest foreign tokens are ``a - 1`` (when ``a > 0``: pieces
    of one rank never touch) and ``b`` (when ``b < L``), so the block part of a piece is its
    first ``right`` keys and its last ``left`` keys, no exchange table needed."""
    cached = _cache.setdefault(plan, {}).get("blocks")
    if cached is not None:
        return cached
    p, mask = plan.stream_pieces, plan.mask
    length = plan.layout.lengths[p.doc]
    head_end = torch.where(p.start > 0, torch.minimum(p.end, p.start + mask.right_bound), p.start)
    tail_start = torch.where(p.end < length, torch.maximum(p.start, p.end - mask.left_bound), p.end)
    joined = head_end >= tail_start
    lo = torch.stack([p.start, torch.where(joined, p.end, tail_start)], 1)
    hi = torch.stack([torch.where(joined, p.end, head_end), p.end], 1)
    rank, doc = (x[:, None].expand(-1, 2).reshape(-1) for x in (p.rank, p.doc))
    blocks = Pieces(rank, doc, lo.reshape(-1), hi.reshape(-1))
    blocks = blocks.select(blocks.end > blocks.start)
    row = offsets_within(blocks.rank, blocks.length)
    sizes = torch.zeros(plan.world_size, dtype=torch.int64).index_add_(0, blocks.rank, blocks.length)
    _cache[plan]["blocks"] = blocks, row, sizes
    return blocks, row, sizes


def _ring(plan: Plan, me: int) -> RingSchedule:
    n, geo = plan.world_size, _Geometry(plan, me)
    blocks, block_row, sizes = _blocks(plan)
    cu = plan.layout.cu_seqlens
    b0, b1 = cu[blocks.doc] + blocks.start, cu[blocks.doc] + blocks.end
    mine = blocks.rank == me
    own_block_rows = geo.local_rows(b0[mine], blocks.length[mine])
    # Keys of every step in one table: the blocks of the other ranks that my queries can see,
    # at rows (block base of their rank + row in the block), then my own rows after all blocks.
    base = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    i, j, g0, g1 = overlaps(geo.seen_g0, geo.seen_g1, b0, b1)
    keep = blocks.rank[j] != me
    i, j, g0, g1 = i[keep], j[keep], g0[keep], g1[keep]
    key_row = torch.cat([base[blocks.rank[j]] + block_row[j] + (g0 - b0[j]), total + geo.local_row])
    key_doc = torch.cat([blocks.doc[j], geo.local.doc])
    key_pos = torch.cat([g0 - cu[blocks.doc[j]], geo.local.start])
    key_len = torch.cat([g1 - g0, geo.local.length])
    local = Segments.packed(geo.local.doc, geo.local.start, geo.local.length)
    slices = local.slices_against(Segments(key_doc, key_row, key_pos, key_len), plan)
    # Back from one table to one list of slices per step.
    at_home = slices.k_start >= total
    src = torch.where(at_home, me, torch.searchsorted(base + sizes, slices.k_start, right=True))
    shift = torch.where(at_home, total, base[src.clamp(max=n - 1)])
    slices = Slices(slices.q_start, slices.q_end, slices.k_start - shift, slices.k_end - shift,
                    slices.q_pos0, slices.k_pos0)
    step = (me - src) % n
    order = torch.argsort(step.to(torch.int32), stable=True)
    counts = torch.bincount(step, minlength=n).tolist()
    columns = [torch.split(getattr(slices, f)[order], counts) for f in
               ("q_start", "q_end", "k_start", "k_end", "q_pos0", "k_pos0")]
    return RingSchedule(own_block_rows, sizes.tolist(), [Slices(*cols) for cols in zip(*columns, strict=True)])
