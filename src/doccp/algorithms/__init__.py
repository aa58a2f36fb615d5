"""Exact context-parallel attention: :func:`attention` and the algorithms behind it.

On every rank q/k/v are that rank's shards (``doccp.shard(x, plan, rank)``); the result on
rank r equals ``shard(varlen_attention(q_full, k_full, v_full, plan.layout, plan.mask), plan, r)``
and gradients flow to the local q/k/v exactly as through the single-device call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from doccp import comm
from doccp.agreement import agree, describe_plan
from doccp.algorithms import allgather, ring_kv, ring_q  # noqa: F401  (each registers its algorithm)
from doccp.algorithms.registry import ALGORITHMS, Call, CPAttention, Shapes, schedule_of, training
from doccp.checks import choice_problem, first, qkv_problem, scale_problem
from doccp.kernels import BACKENDS, default_scale
from doccp.plan import Plan

__all__ = ["attention", "choose_algorithm", "predicted_bytes", "ALGORITHMS", "training"]

#: On devices whose transfers overlap compute (GPU copy engines), an algorithm that hides its
#: hops behind compute (``overlaps_compute``) is charged its bytes divided by this.
OVERLAP_CREDIT = 1.5


def predicted_bytes(plan: Plan, algorithm: str, shapes: Shapes) -> list[int]:
    """Bytes each rank receives in the forward pass under ``algorithm`` (from the plan alone);
    the backward moves as much again (dK/dV go home)."""
    return ALGORITHMS[algorithm].received_bytes(plan, shapes)


def choose_algorithm(plan: Plan, shapes: Shapes, device: torch.device | str | None = None,
                     group: dist.ProcessGroup | None = None) -> str:
    """The ``auto`` rule, over every training algorithm that can run this call: the least
    predicted bytes received by the busiest rank, where an algorithm that overlaps its
    transfers with compute is charged ``1 / OVERLAP_CREDIT`` of its bytes on a GPU (on CPU
    gloo a transfer does not hide behind compute: bench/cp.py, docs/benchmarks.md). Ties go
    to the earlier algorithm in the registry (all-gather first), so a plan that moves nothing
    runs the all-gather."""
    if plan.world_size == 1:
        return "allgather"
    on_gpu = torch.device(device or "cpu").type == "cuda"
    best, best_cost = "allgather", float("inf")
    for name, algorithm in training().items():
        if algorithm.problem(plan, shapes, group) is not None:
            continue
        cost = max(algorithm.received_bytes(plan, shapes), default=0)
        if on_gpu and algorithm.overlaps_compute:
            cost /= OVERLAP_CREDIT
        if cost < best_cost:
            best, best_cost = name, cost
    return best


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan,
              group: dist.ProcessGroup | None = None, algorithm: str = "auto", scale: float | None = None,
              return_lse: bool = False, backend: str = "auto"
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact document-masked attention over CP ranks (see module docstring).

    q ``[T_local, Hq, D]``, k/v ``[T_local, Hkv, D]`` (``Hq % Hkv == 0``), the mask is
    ``plan.mask``. ``algorithm``: ``"allgather"``, ``"ring_kv"`` or ``"auto"``
    (:func:`choose_algorithm`). Returns out ``[T_local, Hq, D]`` and, with ``return_lse``,
    lse ``[Hq, T_local]`` in fp32 (not differentiable). Bad input, or ranks that disagree on the
    plan or the call, raise the same error on every rank (:mod:`doccp.agreement`).
    """
    problem = attention_problem(q, k, v, plan, group, algorithm, backend, scale)
    agree(problem, group, call_fields(q, k, plan, algorithm, backend, scale))
    return run_attention(q, k, v, plan, group, algorithm, scale, return_lse, backend)


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group: dist.ProcessGroup | None,
                  algorithm: str, scale: float | None, return_lse: bool, backend: str
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` after its arguments were checked and agreed on."""
    shapes = Shapes.of(q, k)
    name = choose_algorithm(plan, shapes, q.device, group) if algorithm == "auto" else algorithm
    chosen, rank = ALGORITHMS[name], comm.rank(group)
    call = Call(plan, rank, schedule_of(chosen, plan, rank), plan.mask, default_scale(q, scale), backend, group)
    out, lse = CPAttention.apply(q, k, v, chosen, call)
    return (out, lse) if return_lse else out


def call_fields(q: object, k: object, plan: object, algorithm: object, backend: object, scale: object
                ) -> dict[str, object]:
    """What must be equal on every rank of one CP attention call (see :func:`doccp.agreement.agree`)."""
    tensors = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    return {
        "plan": describe_plan(plan) if isinstance(plan, Plan) else None,
        "algorithm": algorithm,
        "backend": backend,
        "heads and head_dim of q and k": (tuple(q.shape[1:]), tuple(k.shape[1:])) if tensors else None,
        "dtype": str(q.dtype) if tensors else None,
        "device type": q.device.type if tensors else None,
        "scale": scale,
    }


def attention_problem(q: object, k: object, v: object, plan: object, group: dist.ProcessGroup | None,
                      algorithm: object, backend: object, scale: object) -> Exception | None:
    """The first thing wrong with the arguments of a CP attention call on this rank (returned)."""
    problem = first(qkv_problem(q, k, v), scale_problem(scale),
                    choice_problem(algorithm, "algorithm", ["auto", *training()]),
                    choice_problem(backend, "backend", ["auto", *BACKENDS]))
    if problem is not None:
        return problem
    if not isinstance(plan, Plan):
        return TypeError(f"plan must be a doccp.Plan (from doccp.plan(...)), got {type(plan).__name__}")
    problem = comm.check_group(plan.world_size, group)
    if problem is not None:
        return problem
    me = comm.rank(group)
    expected = plan.local_sizes[me]
    if q.shape[0] != expected:
        return ValueError(f"q, k and v have {q.shape[0]} tokens on rank {me}, but the plan gives this rank "
                          f"{expected}; pass doccp.shard(x, plan, {me})")
    if algorithm != "auto":
        return ALGORITHMS[algorithm].problem(plan, Shapes.of(q, k), group)
    return None
