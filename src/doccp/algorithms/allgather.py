"""Selective all-gather KV: fetch exactly the KV local pieces need, attend once.

Only pieces of documents split across ranks travel; documents held whole cost nothing.
The received rows are arranged in document order next to the local ones, so every local
piece is one slice against one contiguous key range (no LSE merge). Backward: the dK/dV
of received rows go back to their owners through the inverse exchange, summed in fp32::

    rank 1 holds doc 7 positions [4, 8), causal; rank 0 holds [0, 4)
    forward:   rank 0 --kv[0:4)--> rank 1      arranged kv on rank 1 = doc 7 [0, 8)
    backward:  rank 1 --dkv[0:4)--> rank 0     added into rank 0's dK/dV in fp32
"""

from __future__ import annotations

import torch

from doccp import comm, kernels
from doccp.algorithms.schedule import AllGatherSchedule


def _peer_shapes(sizes: list[int], me: int, row_shape: torch.Size) -> list[tuple[int, ...] | None]:
    return [None if p == me else (s, *row_shape) for p, s in enumerate(sizes)]


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sched: AllGatherSchedule, mask, scale, backend, group):
        me, hkv = comm.rank(group), k.shape[1]
        kv = torch.cat([k, v], 1)
        sends = [None if p == me else kv.index_select(0, rows.to(kv.device)) for p, rows in enumerate(sched.send_rows)]
        received = comm.exchange(sends, _peer_shapes(sched.recv_sizes, me, kv.shape[1:]), kv, group)
        gathered = torch.cat([kv, *(r for r in received if r is not None)])
        arrange = sched.arrange.to(kv.device)
        k_arr, v_arr = gathered.index_select(0, arrange).split(hkv, 1)
        out, lse = kernels.attend(q, k_arr, v_arr, sched.slices, mask, scale, backend)
        ctx.save_for_backward(q, k_arr, v_arr, out, lse, arrange)
        ctx.sched, ctx.mask, ctx.scale, ctx.backend, ctx.group = sched, mask, scale, backend, group
        ctx.gathered_rows, ctx.local_rows, ctx.kv_dtype = gathered.shape[0], k.shape[0], k.dtype
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k_arr, v_arr, out, lse, arrange = ctx.saved_tensors
        sched, group, local_rows, hkv = ctx.sched, ctx.group, ctx.local_rows, k_arr.shape[1]
        me = comm.rank(group)
        dq, dk, dv = kernels.attend_backward(dout, q, k_arr, v_arr, out, lse, sched.slices, ctx.mask, ctx.scale,
                                             ctx.backend)
        dkv_arr = torch.cat([dk, dv], 1).to(torch.promote_types(dk.dtype, torch.float32))  # fp32 sums
        dkv = dkv_arr.new_zeros((ctx.gathered_rows, *dkv_arr.shape[1:])).index_add_(0, arrange, dkv_arr)
        # Received rows' gradients go back to their owners; ours come back from them.
        bounds = torch.tensor([local_rows, *sched.recv_sizes]).cumsum(0).tolist()
        sends = [None if p == me else dkv[bounds[p]:bounds[p + 1]] for p in range(len(sched.recv_sizes))]
        shapes = _peer_shapes([len(r) for r in sched.send_rows], me, dkv.shape[1:])
        returned = comm.exchange(sends, shapes, dkv, group)
        dkv_local = dkv[:local_rows]
        for rows_sent, grad in zip(sched.send_rows, returned, strict=True):
            if grad is not None:
                dkv_local.index_add_(0, rows_sent.to(grad.device), grad)
        dk_local, dv_local = dkv_local.to(ctx.kv_dtype).split(hkv, 1)
        return dq, dk_local, dv_local, None, None, None, None, None
