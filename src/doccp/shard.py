"""Move tensors between the packed stream and CP ranks, following a plan (differentiable).

``shard`` keeps the rank's tokens in the plan's local order (an index_select, whose
backward scatters the gradient back). ``unshard`` all-gathers the local shards and
restores stream order; its backward returns the rank's own slice of the gradient, which
is the gradient of the shard when every rank computes the same function of the result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from doccp import comm
from doccp.agreement import agree, describe_plan
from doccp.checks import raise_if
from doccp.plan import Plan


def shard(x: torch.Tensor, plan: Plan, rank: int, dim: int = 0) -> torch.Tensor:
    """The tokens of ``rank`` along ``dim`` of a full-stream tensor ``x``, in local order."""
    raise_if(_problem(x, plan, dim, "x"))
    plan.layout.check_tokens(x, "x", dim=_dim(x, dim))
    return x.index_select(_dim(x, dim), plan.indices(rank).to(x.device))


def unshard(x_local: torch.Tensor, plan: Plan, group: dist.ProcessGroup | None = None,
            dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard` over a process group: every rank gets the full stream."""
    me = comm.rank(group)
    problem = _problem(x_local, plan, dim, "x_local") or comm.check_group(plan.world_size, group)
    if problem is None:
        d = _dim(x_local, dim)
        if x_local.shape[d] != plan.local_sizes[me]:
            problem = ValueError(f"x_local has {x_local.shape[d]} tokens along dim {dim}, but the plan gives "
                                 f"rank {me} {plan.local_sizes[me]}; pass doccp.shard(x, plan, {me}) output")
    tensor = isinstance(x_local, torch.Tensor)
    agree(problem, group, {
        "plan": describe_plan(plan) if isinstance(plan, Plan) else None,
        "dim": dim,
        "x_local shape (but the token dim) and dtype": (
            tuple(s for i, s in enumerate(x_local.shape) if i != _dim(x_local, dim)), str(x_local.dtype))
        if problem is None and tensor else None,
    })
    return _Unshard.apply(x_local, plan, group, _dim(x_local, dim))


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, plan, group, dim):
        ctx.plan, ctx.dim, ctx.rank = plan, dim, comm.rank(group)
        parts = comm.all_gather_varsize(x_local, plan.local_sizes, group, dim=dim)
        order = torch.cat([plan.indices(r) for r in range(plan.world_size)]).to(x_local.device)
        gathered = torch.cat(parts, dim)
        out = torch.empty_like(gathered)
        return out.index_copy_(dim, order, gathered)

    @staticmethod
    def backward(ctx, grad):
        own = grad.index_select(ctx.dim, ctx.plan.indices(ctx.rank).to(grad.device))
        return own, None, None, None


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim + x.dim() if dim < 0 else dim


def _problem(x: object, plan: object, dim: object, name: str) -> Exception | None:
    if not isinstance(x, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(plan, Plan):
        return TypeError(f"plan must be a doccp.Plan (from doccp.plan(...)), got {type(plan).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < max(x.dim(), 1):
        return ValueError(f"dim={dim!r} is out of range for a {x.dim()}-D {name}")
    return None
