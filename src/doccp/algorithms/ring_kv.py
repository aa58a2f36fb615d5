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
"""

from __future__ import annotations

import torch

from doccp import comm, kernels
from doccp.algorithms.schedule import RingSchedule
from doccp.algorithms.work import Work, accumulators, attend_into, take_rows


def _block_shape(sched: RingSchedule, owner: int, like: torch.Tensor) -> tuple[int, ...]:
    return (sched.block_sizes[owner % len(sched.block_sizes)], *like.shape[1:])


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_rows: torch.Tensor, block_sizes: list[int],
                 steps: list[Work], scale: float, backend: str, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass-KV forward loop, shared by training and inference prefill.

    ``k``/``v`` are the rank's own key rows (step 0); ``k[block_rows]``/``v[block_rows]`` is the
    block this rank sends around the ring, and ``block_sizes[r]`` the rows of rank r's block.
    At step t the block of rank ``me - t`` is here and ``steps[t]`` is the work of the local
    queries against it. Returns fp32 (fp64 for fp64) out and lse.
    """
    me, n = comm.rank(group), comm.size(group)
    out, lse = accumulators(q, dim=v.shape[2])
    block = [take_rows(k, block_rows), take_rows(v, block_rows)]
    for t in range(n):
        shapes = [(block_sizes[(me - t - 1) % n], *x.shape[1:]) for x in (k, v)]
        hop = comm.RingStep(block, shapes, [k, v], group) if t < n - 1 else None
        k_t, v_t = (k, v) if t == 0 else block
        attend_into(out, lse, q, k_t, v_t, steps[t], scale, backend)
        if hop is not None:
            block = hop.wait()
    return out, lse


class RingKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sched: RingSchedule, mask, scale, backend, group):
        steps = [[(s, mask)] for s in sched.step_slices]
        out, lse = ring_forward(q, k, v, sched.own_block_rows, sched.block_sizes, steps, scale, backend, group)
        out = out.to(q.dtype)  # lse stays fp32 (fp64 for fp64 inputs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sched, ctx.mask, ctx.scale, ctx.backend, ctx.group = sched, mask, scale, backend, group
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        sched, mask, scale, backend, group = ctx.sched, ctx.mask, ctx.scale, ctx.backend, ctx.group
        me, n, hkv = comm.rank(group), comm.size(group), k.shape[1]
        kv = torch.cat([k, v], 1)
        grad_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros_like(q, dtype=grad_dtype)
        dkv = torch.zeros_like(kv, dtype=grad_dtype)
        block = kv.index_select(0, sched.own_block_rows.to(kv.device))
        acc, acc_hop = None, None
        for t in range(n):
            hop = comm.RingStep([block], [_block_shape(sched, me - t - 1, kv)], [kv], group) if t < n - 1 else None
            if acc_hop is not None:  # the accumulator of the block we hold, from the previous rank
                acc = acc_hop.wait()[0]
            k_t, v_t = (k, v) if t == 0 else block.split(hkv, 1)
            if t > 0 and acc is None:
                acc = torch.zeros(block.shape, dtype=grad_dtype, device=block.device)
            if len(sched.step_slices[t]):
                g_q, g_k, g_v = kernels.attend_backward(dout, q, k_t, v_t, out, lse, sched.step_slices[t],
                                                        mask, scale, backend)
                dq += g_q
                (dkv if t == 0 else acc).add_(torch.cat([g_k, g_v], 1))
            if t > 0:  # pass the accumulator on; after the last step it reaches the block's owner
                acc_hop = comm.RingStep([acc], [_block_shape(sched, me - t - 1 if t < n - 1 else me, kv)],
                                        [acc], group)
            if hop is not None:
                block = hop.wait()[0]
        if acc_hop is not None:
            home = acc_hop.wait()[0]
            dkv.index_add_(0, sched.own_block_rows.to(dkv.device), home)
        dk, dv = dkv.split(hkv, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
