"""Selective all-gather KV: fetch exactly the KV local pieces need, attend once.

Only pieces of documents split across ranks travel; documents held whole cost nothing.
The received rows are arranged in document order next to the local ones, so every local
piece is one slice against one contiguous key range (no LSE merge). Backward: the dK/dV
of received rows go back to their owners through the inverse exchange, summed in fp32::

    rank 1 holds doc 7 positions [4, 8), causal; rank 0 holds [0, 4)
    forward:   rank 0 --kv[0:4)--> rank 1      arranged kv on rank 1 = doc 7 [0, 8)
    backward:  rank 1 --dkv[0:4)--> rank 0     added into rank 0's dK/dV in fp32

A rank that receives nothing (one rank, or every document it sees held whole: many ``balanced``
plans) attends to its k and v as they are: no concatenated copy, and in the backward no fp32
round trip of dK/dV unless its own rows' gradients come back from the ranks it sent them to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from doccp import comm, kernels
from doccp.algorithms.registry import Algorithm, Call, Shapes, register
from doccp.algorithms.schedule import Geometry
from doccp.algorithms.work import take_rows
from doccp.device_copies import on_device
from doccp.kernels.runs import Runs
from doccp.kernels.slices import Slices
from doccp.plan import Plan
from doccp.plan.exchange import document_overlaps, overlaps, prefix_receivers
from doccp.ranges import expand, offsets_within, starts, take


@dataclass(frozen=True)
class AllGatherSchedule:
    """Selective all-gather: exchange exactly the minimal KV, arrange it in document order."""

    send_rows: list[torch.Tensor]  # local rows to send to each peer
    recv_sizes: list[int]  # rows received from each peer
    arrange: torch.Tensor  # rows of cat(local, received...) forming the arranged buffer
    slices: Slices  # local queries vs arranged buffer: one slice per local piece
    sends: bool  # whether any rows go to a peer
    in_place: bool  # nothing arrives and the arranged buffer is the local rows as they are


class AllGather(Algorithm):
    name = "allgather"
    summary = "fetch exactly the KV rows local queries see (documents held whole cost nothing), attend once"

    def schedule(self, plan: Plan, me: int) -> AllGatherSchedule:
        n, geo = plan.world_size, Geometry(plan, me)
        # Receive: my visible keys cut at the stream's pieces; the parts others hold arrive from
        # each peer in stream order, after my local rows.
        i, j, g0, g1 = overlaps(*geo.seen_bounds, *plan.stream_bounds)
        src, length = take(plan.stream_pieces.rank, j), g1 - g0
        recv_sizes = torch.zeros(n, dtype=torch.int64).index_add_(0, src, length)
        recv_sizes[me] = 0
        peer_base = int(geo.local.length.sum()) + starts(recv_sizes)
        row = take(peer_base, src).add_(offsets_within(src, length))  # my own parts are local rows:
        own = torch.nonzero(src == me).squeeze(1)
        own_g0 = take(g0, own)
        piece = torch.searchsorted(geo.local_g0, own_g0, right=True) - 1
        row.scatter_(0, own, take(geo.local_row, piece) + (own_g0 - take(geo.local_g0, piece)))
        arrange = expand(row, length)
        # Send: every other rank's visible keys cut at my pieces, ordered by (peer, doc, start).
        # Under a causal mask whole pieces go to the ranks holding later parts of their document.
        if plan.causal_like:
            j, dst = prefix_receivers(plan.stream_pieces, plan.last_pieces, plan.stream_index(me), me, n)
            length = take(geo.local.length, j)
            rows = expand(take(geo.local_row, j), length)
        else:
            seen = plan.seen  # rank order: mine are one run of it
            mine = slice(*torch.searchsorted(seen.rank, torch.tensor([me, me + 1])).tolist())
            i, j, lo, hi = document_overlaps(seen.doc, seen.start, seen.end, geo.local, plan.layout.num_docs,
                                             skip=mine)
            dst, length = take(seen.rank, i), hi - lo
            rows = expand(take(geo.local_row, j) + (lo - take(geo.local.start, j)), length)
        send_sizes = torch.zeros(n, dtype=torch.int64).index_add_(0, dst, length)
        send_rows = list(torch.split(rows, send_sizes.tolist()))
        arranged = Runs.laid_out(geo.seen.doc, geo.seen.start, geo.seen.length)
        in_place = int(recv_sizes.sum()) == 0 and torch.equal(arrange, torch.arange(plan.local_sizes[me]))
        return AllGatherSchedule(send_rows, recv_sizes.tolist(), arrange, geo.runs.slices_against(arranged, plan.mask),
                                 sends=bool(send_sizes.sum()), in_place=in_place)

    def received_bytes(self, plan: Plan, shapes: Shapes) -> list[int]:
        row = 2 * shapes.kv_heads * shapes.head_dim * shapes.element_bytes  # K and V
        return [tokens * row for tokens in plan.kv_received]

    def forward(self, q, k, v, call: Call):
        sched: AllGatherSchedule = call.schedule
        me, hkv = call.rank, k.shape[1]
        kv = torch.cat([k, v], 1) if sched.sends or not sched.in_place else None  # K and V travel as one
        if kv is not None:
            sends = [None if p == me else take_rows(kv, rows) for p, rows in enumerate(sched.send_rows)]
            received = [r for r in comm.exchange(sends, _peer_shapes(sched.recv_sizes, me, kv.shape[1:]), kv,
                                                 call.group) if r is not None]
        if sched.in_place:
            k_arr, v_arr, arrange = k, v, None
        else:
            gathered = torch.cat([kv, *received]) if received else kv
            arrange = on_device(sched.arrange, kv.device)
            k_arr, v_arr = take_rows(gathered, sched.arrange).split(hkv, 1)  # a view when nothing moved
        out, lse = kernels.attend(q, k_arr, v_arr, sched.slices, call.mask, call.scale, call.backend)
        return out, lse, (q, k_arr, v_arr, out, lse, arrange)

    def backward(self, dout, saved, call: Call):
        q, k_arr, v_arr, out, lse, arrange = saved
        sched: AllGatherSchedule = call.schedule
        me, hkv = call.rank, k_arr.shape[1]
        local_rows = call.plan.local_sizes[me]
        dq, dk, dv = kernels.attend_backward(dout, q, k_arr, v_arr, out, lse, sched.slices, call.mask, call.scale,
                                             call.backend)
        if sched.in_place and not sched.sends:
            return dq, dk, dv  # nothing moved either way
        dkv_arr = torch.cat([dk, dv], 1).to(torch.promote_types(dk.dtype, torch.float32))  # fp32 sums
        rows = local_rows + sum(sched.recv_sizes)
        dkv = dkv_arr if arrange is None else dkv_arr.new_zeros((rows, *dkv_arr.shape[1:])).index_add_(0, arrange,
                                                                                                        dkv_arr)
        # Received rows' gradients go back to their owners; ours come back from them.
        bounds = torch.tensor([local_rows, *sched.recv_sizes]).cumsum(0).tolist()
        sends = [None if p == me else dkv[bounds[p]:bounds[p + 1]] for p in range(len(sched.recv_sizes))]
        shapes = _peer_shapes([len(r) for r in sched.send_rows], me, dkv.shape[1:])
        returned = comm.exchange(sends, shapes, dkv, call.group)
        dkv_local = dkv[:local_rows]
        for rows_sent, grad in zip(sched.send_rows, returned, strict=True):
            if grad is not None:
                dkv_local.index_add_(0, on_device(rows_sent, grad.device), grad)
        dk_local, dv_local = dkv_local.to(k_arr.dtype).split(hkv, 1)
        return dq, dk_local, dv_local


def _peer_shapes(sizes: list[int], me: int, row_shape: torch.Size) -> list[tuple[int, ...] | None]:
    return [None if p == me else (s, *row_shape) for p, s in enumerate(sizes)]


register(AllGather())
