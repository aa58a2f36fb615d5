"""Sum gradients over the CP group: each rank's loss is a part of one sum, so are its gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from doccp import comm

#: Gradients are reduced in flat buffers of at most this many elements (bounded extra memory).
BUCKET_ELEMENTS = 1 << 25


@torch.no_grad()
def all_reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce (sum) the gradients of ``model``'s parameters over the CP ``group``.

    Call it after ``backward`` and before the optimizer step. Gradients travel flattened (a few
    collectives per dtype and device, buffers of at most ``BUCKET_ELEMENTS``), after one small
    collective that agrees on which parameters have a gradient on any rank, so a parameter
    unused on one rank cannot hang the others (its gradient is taken as zero there); a parameter
    unused on every rank stays ``None``.

    With data parallelism too (a DP x CP mesh), reduce over the CP group here and let DDP average
    over the data-parallel group (``DDP(model, process_group=dp_group)``); or skip this call, wrap
    the model over the whole world and multiply the loss by the CP size (docs/hf.md).
    """
    if comm.size(group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if isinstance(p.grad, DTensor):
            raise TypeError(f"all_reduce_gradients takes plain tensor gradients, got {type(p.grad).__name__}; "
                            "with FSDP2 let its reduce-scatter span the CP ranks instead (docs/hf.md)")
    if not params:
        return
    device = next((p.grad.device for p in params if p.grad is not None), params[0].device)
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    by_kind: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for p, used in zip(params, has_grad.tolist(), strict=True):
        if not used:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets = by_kind.setdefault((p.grad.dtype, p.grad.device), [[]])
        if buckets[-1] and sum(g.numel() for g in buckets[-1]) + p.grad.numel() > BUCKET_ELEMENTS:
            buckets.append([])
        buckets[-1].append(p.grad)
    for grads in (bucket for buckets in by_kind.values() for bucket in buckets):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
