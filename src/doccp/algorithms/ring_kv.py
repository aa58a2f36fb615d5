"""Ring pass-KV: N-1 hops; at step t rank r attends to the KV block of rank r - t.

A rank's *block* is only the rows some other rank needs (documents held whole never
travel). Each hop is posted before the step's compute so transfer overlaps compute;
partial results merge by LSE in fp32. Backward replays the ring with the saved final
out/lse (no forward recompute); each block's dK/dV accumulator travels behind it and
arrives home after the last step::

    N = 3, forward        step 0      step 1      step 2
    rank 0 attends to     kv0         kv2         kv1
    rank 1 attends to     kv1         kv0         kv2
    rank 2 attends to     kv2         kv1         kv0
    backward: dkv_b follows kv_b one hop behind; after step 2 it is back at rank b.

The same loop (:func:`ring_forward`) serves inference: prefill "pass-KV" sends the blocks of
every rank's KV cache (cached and new keys) around the ring instead of a plan's pieces.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from doccp import comm, kernels
from doccp.algorithms.registry import Algorithm, Call, Shapes, register
from doccp.algorithms.schedule import Geometry
from doccp.algorithms.work import accumulators_dtype, attend_into, attend_work, take_rows
from doccp.device_copies import on_device
from doccp.kernels.runs import Runs, Work, clip_to_others, keys_seen, work
from doccp.kernels.slices import FIELDS, Slices, paired
from doccp.plan import Plan
from doccp.plan.exchange import overlaps
from doccp.ranges import any_true, batches, expand, index_of, repeat, run_entries, stable_order, starts, take


@dataclass(frozen=True)
class RingSchedule:
    """Ring pass-KV: every rank's block (its rows some other rank needs) visits every rank."""

    own_block_rows: torch.Tensor  # local rows forming this rank's block
    block_sizes: list[int]  # block rows of every rank
    step_slices: list[Slices]  # step t: local queries vs the block of rank (me - t) % N


_blocks_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class RingBlocks(NamedTuple):
    """Every rank's ring block as intervals in stream order: owner ``rank``, stream offsets
    ``[g0, g1)``, the ``row`` of each interval within its owner's block; and every rank's block
    ``sizes``."""

    rank: torch.Tensor
    g0: torch.Tensor
    g1: torch.Tensor
    row: torch.Tensor
    sizes: torch.Tensor


class CausalBlocks(NamedTuple):
    """Under a causal mask every piece but each document's last travels whole (every later token
    of its document, on another rank, sees all of it). The blocks in rank order, so each rank's
    block is one run of the table (``counts[r]`` entries, rank r's after rank r - 1's), its pieces
    in stream order: stream ``index``, ``doc``, document-relative ``start``, ``length`` and ``row``
    in the block; and every rank's block ``sizes``."""

    index: torch.Tensor
    doc: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    row: torch.Tensor
    counts: torch.Tensor
    sizes: torch.Tensor


def ring_blocks(plan: Plan) -> RingBlocks | CausalBlocks:
    """Every rank's ring block (cached per plan).

    Key ``j`` of a piece ``[a, b)`` is needed by another rank iff a foreign query sees it. The
    nearest foreign tokens are ``a - 1`` (when ``a > 0``: pieces of one rank never touch) and
    ``b`` (when ``b < L``), and the mask is a monotone interval mask, so the block part of a
    piece is its keys up to the last one query ``a - 1`` sees and from the first one query ``b``
    sees (for a band: its first ``right`` and last ``left`` keys); no exchange table needed.
    Under a causal mask that is every piece but each document's last, whole (:class:`CausalBlocks`)."""
    if plan in _blocks_of:
        return _blocks_of[plan]
    blocks = _causal_blocks(plan) if plan.causal_like else _mask_blocks(plan)
    _blocks_of[plan] = blocks
    return blocks


def _causal_blocks(plan: Plan) -> CausalBlocks:
    """:class:`CausalBlocks`: one filter of the rank order, and each block's row from one cumsum
    (``head_tail`` at 16M tokens over 1024 ranks has 14M pieces)."""
    p, order = plan.stream_pieces, plan.rank_order
    travels = torch.zeros(len(p), dtype=torch.bool)
    torch.eq(p.doc[1:], p.doc[:-1], out=travels[:-1])  # a later piece of its document follows
    kept = torch.nonzero(travels.index_select(0, order)).squeeze(1)  # positions in the rank order
    index = take(order, kept)
    start = take(p.start, index)
    length = take(p.end, index).sub_(start)
    bounds = torch.searchsorted(kept, torch.tensor(plan.rank_bounds))  # each rank's run of blocks
    before = torch.zeros(len(index) + 1, dtype=torch.int64)  # rows of all blocks before, by the rank order
    torch.cumsum(length, 0, out=before[1:])
    sizes = torch.diff(take(before, bounds))
    counts = torch.diff(bounds)
    row = before[:-1].sub_(repeat(starts(sizes), counts, len(index)))  # within its owner's block
    return CausalBlocks(index, take(p.doc, index), start, length, row, counts, sizes)


def _mask_blocks(plan: Plan) -> RingBlocks:
    """:func:`ring_blocks` under any mask: the parts of each piece the nearest foreign queries see."""
    p, mask = plan.stream_pieces, plan.mask
    length = take(plan.layout.lengths, p.doc)
    after = mask.visible_keys(p.end, p.end + 1, length)[0]
    tail_start = torch.where(p.end < length, torch.clamp(torch.as_tensor(after), p.start, p.end), p.end)
    used = []
    if mask.looks_ahead:  # else query a - 1 sees no key from a on: no piece has a head part
        before = mask.visible_keys(p.start - 1, p.start, length)[1]
        head_end = torch.where(p.start > 0, torch.clamp(torch.as_tensor(before), p.start, p.end), p.start)
        joined = head_end >= tail_start
        head = p.start, torch.where(joined, p.end, head_end)
        tail_start = torch.where(joined, p.end, tail_start)
        used = [head] if any_true(head[1] > head[0]) else []
    tail = tail_start, p.end
    g0, g1 = plan.stream_bounds
    base = g0 - p.start  # each piece's document's stream offset
    if used and any_true(tail[1] > tail[0]):  # a piece may have two parts: two entries per piece
        lo, hi = torch.stack([head[0], tail[0]], 1), torch.stack([head[1], tail[1]], 1)
        rank, base = (x[:, None].expand_as(lo).reshape(-1) for x in (p.rank, base))
    else:  # one part per piece at most (causal: the tail, which may be all of it)
        (lo, hi), rank = (used or [tail])[0], p.rank
    size = hi - lo
    lo, hi = base + lo.reshape(-1), g1 if hi is p.end else base + hi.reshape(-1)
    row = plan.rank_offsets(size).reshape(-1)
    size = size.reshape(-1)
    sizes = torch.zeros(plan.world_size, dtype=torch.int64).index_add_(0, rank, size)
    keep = index_of(size > 0)
    return RingBlocks(*(take(x, keep) for x in (rank, lo, hi, row)), sizes)


def _causal_visits(plan: Plan, me: int, geo: Geometry, blocks: CausalBlocks) -> tuple[torch.Tensor, list[Slices]]:
    """My block's local rows and the slices of steps 1..N-1 under a causal mask. A block is seen
    whole by exactly my pieces after it in its document, a run of my local pieces, so the slices
    are built block by block in rank order (each owner's run is one step's slices): no search
    and no sort. They are written a batch of blocks at a time (:func:`~doccp.ranges.batches`):
    ``head_tail`` at 16M tokens over 1024 ranks lists 8M slices of 14.8M blocks."""
    n = plan.world_size
    before = take(plan.pieces_before(me), blocks.index)  # my local pieces before each block
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(blocks.counts, 0)])
    mine = slice(*bounds[me:me + 2].tolist())
    own_block_rows = expand(take(geo.local_row, before[mine]), blocks.length[mine])
    through = torch.cumsum(torch.bincount(geo.local.doc, minlength=plan.layout.num_docs), 0)  # mine up to each doc
    count = take(through, blocks.doc).sub_(before)  # my pieces after the block in its document
    count[mine] = 0  # my own block: step 0, the home slices
    parts = batches(count)
    visiting = Slices(*(torch.empty(parts[-1][3] if parts else 0, dtype=torch.int64) for _ in FIELDS))
    for b0, b1, e0, e1 in parts:
        _block_slices(geo.runs, blocks, b0, before[b0:b1], count[b0:b1], visiting.select(slice(e0, e1)))
    rows = torch.zeros(len(count) + 1, dtype=torch.int64)
    torch.cumsum(count, 0, out=rows[1:])  # slices before each block
    by_owner = _split(visiting, torch.diff(take(rows, bounds)).tolist())
    return own_block_rows, [by_owner[(me - t) % n] for t in range(1, n)]


def _block_slices(q: Runs, blocks: CausalBlocks, b0: int, before: torch.Tensor, count: torch.Tensor,
                  out: Slices) -> None:
    """Write the slices of blocks ``b0, b0 + 1, ...`` (``count`` local pieces each, from local piece
    ``before``) into ``out`` (views of the schedule's columns)."""
    j, i, _ = run_entries(before, count)  # each slice's block (from b0) and local piece
    j += b0
    torch.index_select(q.row, 0, i, out=out.q_start)
    torch.add(out.q_start, take(q.length, i), out=out.q_end)
    torch.index_select(blocks.row, 0, j, out=out.k_start)
    torch.add(out.k_start, take(blocks.length, j), out=out.k_end)
    torch.index_select(q.pos, 0, i, out=out.q_pos0)
    torch.index_select(blocks.start, 0, j, out=out.k_pos0)


def _mask_visits(plan: Plan, me: int, geo: Geometry, blocks: RingBlocks) -> tuple[torch.Tensor, list[Slices]]:
    """My block's local rows and the slices of steps 1..N-1 under any mask: the keys each local
    piece sees cut at the blocks (stream order: one binary search per piece), at their rows within
    their block, ordered by the step their block's owner visits and trimmed to the rows that see
    them (my own block's parts fall in step 0, which the home slices replace)."""
    n, q = plan.world_size, geo.runs
    b0, b1 = blocks.g0, blocks.g1
    mine = torch.nonzero(blocks.rank == me).squeeze(1)
    own_b0 = take(b0, mine)
    own_block_rows = geo.local_rows(own_b0, take(b1, mine) - own_b0)
    i, j, g0, g1 = overlaps(*geo.visible_bounds(), b0, b1)
    key_row, key_pos = take(blocks.row, j) + (g0 - take(b0, j)), g0 - take(geo.local_base, i)
    step = take(torch.arange(me, me - n, -1) % n, take(blocks.rank, j))  # (me - owner) % n
    order = stable_order(step, n)
    i, key_row, key_pos, key_len = (take(x, order) for x in (i, key_row, key_pos, g1 - g0))
    visiting, kept = paired(q.row, q.pos, q.length, i, key_row, key_pos, key_len, plan.mask, keys_seen=True)
    # rows are in step order now: each step's rows end where the cumulative counts say (of the
    # pairs kept, when some were dropped: paired keeps pairs in order)
    ends = torch.cumsum(torch.bincount(step, minlength=n), 0)
    if kept is not None:
        ends = torch.searchsorted(kept, ends)
    return own_block_rows, _split(visiting, torch.diff(ends, prepend=ends.new_zeros(1)).tolist())[1:]


def _split(slices: Slices, counts: list[int]) -> list[Slices]:
    """``slices`` cut into consecutive runs of ``counts[k]`` rows."""
    return [Slices(*cols) for cols in zip(*(torch.split(getattr(slices, f), counts) for f in FIELDS), strict=True)]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_rows: torch.Tensor, block_sizes: list[int],
                 steps: list[Work], scale: float, backend: str, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass-KV forward loop, shared by training and inference prefill.

    ``k``/``v`` are the rank's own key rows (step 0); ``k[block_rows]``/``v[block_rows]`` is the
    block this rank sends around the ring, and ``block_sizes[r]`` the rows of rank r's block.
    At step t the block of rank ``me - t`` is here and ``steps[t]`` is the work of the local
    queries against it. Returns fp32 (fp64 for fp64) out and lse.
    """
    me, n = comm.rank(group), comm.size(group)
    block = [take_rows(k, block_rows), take_rows(v, block_rows)]
    for t in range(n):
        shapes = [(block_sizes[(me - t - 1) % n], *x.shape[1:]) for x in (k, v)]
        hop = comm.RingStep(block, shapes, [k, v], group) if t < n - 1 else None
        if t == 0:
            out, lse = attend_work(q, k, v, steps[0], scale, backend)
        else:
            attend_into(out, lse, q, *block, steps[t], scale, backend)
        if hop is not None:
            block = hop.wait()
    return out, lse


class RingKV(Algorithm):
    name = "ring_kv"
    summary = "KV blocks (only rows another rank sees) travel the ring, each hop hidden behind a step of compute"
    prefill_name = "pass_kv"
    overlaps_compute = True

    def schedule(self, plan: Plan, me: int) -> RingSchedule:
        geo = Geometry(plan, me)
        blocks = ring_blocks(plan)
        q = geo.runs
        home = q.slices_against(q, plan.mask)  # step 0: my queries against my own rows
        visits = _causal_visits if isinstance(blocks, CausalBlocks) else _mask_visits
        own_block_rows, steps = visits(plan, me, geo, blocks)
        return RingSchedule(own_block_rows, blocks.sizes.tolist(), [home, *steps])

    def received_bytes(self, plan: Plan, shapes: Shapes) -> list[int]:
        """Every other rank's block visits each rank once."""
        sizes = ring_blocks(plan).sizes.tolist()
        row = 2 * shapes.kv_heads * shapes.head_dim * shapes.element_bytes
        return [(sum(sizes) - own) * row for own in sizes]

    def forward(self, q, k, v, call: Call):
        sched: RingSchedule = call.schedule
        steps = [[(s, call.mask)] for s in sched.step_slices]
        out, lse = ring_forward(q, k, v, sched.own_block_rows, sched.block_sizes, steps, call.scale, call.backend,
                                call.group)
        out = out.to(q.dtype)  # lse stays fp32 (fp64 for fp64 inputs)
        return out, lse, (q, k, v, out, lse)

    def backward(self, dout, saved, call: Call):
        q, k, v, out, lse = saved
        sched: RingSchedule = call.schedule
        me, n, hkv, group = call.rank, call.plan.world_size, k.shape[1], call.group
        grad_dtype = accumulators_dtype(q)
        block = torch.cat([take_rows(k, sched.own_block_rows), take_rows(v, sched.own_block_rows)], 1)
        row_shape = block.shape[1:]

        def block_shape(owner: int) -> tuple[int, ...]:
            return (sched.block_sizes[owner % n], *row_shape)

        # dq and my rows' dK/dV start as step 0's gradients (upcast), not as zeros they are added to
        dq = dkv = acc = acc_hop = None
        for t in range(n):
            hop = comm.RingStep([block], [block_shape(me - t - 1)], [block], group) if t < n - 1 else None
            if acc_hop is not None:  # the accumulator of the block we hold, from the previous rank
                acc = acc_hop.wait()[0]
            k_t, v_t = (k, v) if t == 0 else block.split(hkv, 1)
            if t > 0 and acc is None:
                acc = torch.zeros(block.shape, dtype=grad_dtype, device=block.device)
            if len(sched.step_slices[t]):
                g_q, g_k, g_v = kernels.attend_backward(dout, q, k_t, v_t, out, lse, sched.step_slices[t],
                                                        call.mask, call.scale, call.backend)
                dq = g_q.to(grad_dtype) if dq is None else dq.add_(g_q)
                g_kv = torch.cat([g_k, g_v], 1)
                if t == 0:
                    dkv = g_kv.to(grad_dtype)
                else:
                    acc.add_(g_kv)
            if t > 0:  # pass the accumulator on; after the last step it reaches the block's owner
                acc_hop = comm.RingStep([acc], [block_shape(me - t - 1 if t < n - 1 else me)], [acc], group)
            if hop is not None:
                block = hop.wait()[0]
        if dq is None:
            dq = torch.zeros_like(q, dtype=grad_dtype)
        if dkv is None:
            dkv = torch.zeros((k.shape[0], *row_shape), dtype=grad_dtype, device=k.device)
        if acc_hop is not None:
            home = acc_hop.wait()[0]
            dkv.index_add_(0, on_device(sched.own_block_rows, dkv.device), home)
        dk, dv = dkv.split(hkv, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def prefill(self, q, cache, queries: Runs, scale, backend, group):
        """Pass-KV over a KV cache: each rank's block is its cached keys some other rank's new
        queries can see (within the mask's reach of their hull), sent around the ring."""
        me, n, mask, seqs = cache.rank, cache.world_size, cache.mask, cache.num_seqs
        lo, hi = keys_seen(mask, *queries.hull(n * seqs, queries.rank * seqs + queries.doc))
        blocks = [clip_to_others(cache.runs.select(cache.runs.rank == s), lo, hi, s, n) for s in range(n)]
        local = queries.select(queries.rank == me)
        steps = [work(local, cache.local_runs(), mask)]
        steps += [work(local, blocks[(me - t) % n].packed(), mask) for t in range(1, n)]
        sizes = [int(b.length.sum()) for b in blocks]
        return ring_forward(q, cache.k, cache.v, cache.buffer_rows(blocks[me]), sizes, steps, scale, backend, group)


register(RingKV())
