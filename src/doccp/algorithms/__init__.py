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

# Each module registers its algorithm on import, so this order is the registry's: the order of ``auto``'s ties,
# the demo and the benchmarks (the token-splitting algorithms first, then the head-splitting ones).
# isort: off
from doccp.algorithms import allgather, ring_kv, ring_q, ulysses, hybrid  # noqa: F401
# isort: on

from doccp.algorithms.registry import ALGORITHMS, Call, CPAttention, Shapes, schedule_of, training
from doccp.checks import choice_problem, first, qkv_problem, scale_problem
from doccp.comm import HybridGroup
from doccp.kernels import BACKENDS, default_scale
from doccp.plan import Plan

__all__ = ["attention", "choose_algorithm", "predicted_bytes", "ALGORITHMS", "training", "HybridGroup"]

#: On devices whose transfers overlap compute (GPU copy engines), an algorithm that hides its
#: hops behind compute (``overlaps_compute``) is charged its bytes divided by this.
OVERLAP_CREDIT = 1.5

#: Attention FLOPs one rank computes in the time it receives one byte, by device type: the
#: exchange rate between work and traffic in the ``auto`` rule (an order of magnitude is what
#: matters). CPU: a gloo rank computes some 10-30 GFLOP/s of attention (4 per pair, head and
#: head dim) and receives about 1-2 GB/s; CUDA: an H100 computes some 300 TFLOP/s of attention
#: and receives some 100-300 GB/s (NVLink; less across nodes).
FLOPS_PER_BYTE = {"cpu": 16.0, "cuda": 1000.0}

Group = dist.ProcessGroup | HybridGroup | None


def predicted_bytes(plan: Plan, algorithm: str, shapes: Shapes, group: Group = None) -> list[int]:
    """Bytes each rank receives in the forward pass under ``algorithm`` on ``group`` (from the
    plan alone; the hybrid needs its HybridGroup); the backward moves about as much again."""
    return ALGORITHMS[algorithm].for_group(group).received_bytes(plan, shapes)


def choose_algorithm(plan: Plan, shapes: Shapes, device: torch.device | str | None = None, group: Group = None,
                     flops_per_byte: float | None = None) -> str:
    """The ``auto`` rule: of every training algorithm that can run this call on ``group``, the
    one whose busiest rank is predicted to finish first. A rank's cost is what it receives in
    the forward pass (``received_bytes``) plus its attention FLOPs (``flops``) divided by
    ``flops_per_byte`` (default :data:`FLOPS_PER_BYTE` for the device type); an algorithm that
    overlaps its transfers with compute is charged ``1 / OVERLAP_CREDIT`` of its bytes on a GPU
    (on CPU gloo a transfer does not hide behind compute: bench/cp.py, docs/benchmarks.md).

    So traffic decides between algorithms that share the plan's work (all-gather and ring), and
    work balance counts against traffic where the work differs: Ulysses moves the same bytes
    however the documents are cut and gives every rank ``1/N`` of the total work, so it wins
    where the KV exchange is heavy (long documents cut over many ranks) or the plan is
    unbalanced; the hybrid competes only when ``group`` is a :class:`~doccp.comm.HybridGroup`.
    Ties go to the earlier algorithm in the registry (all-gather first), so a plan that moves
    nothing and is balanced runs the all-gather. Every rank computes the same choice.
    """
    if plan.world_size == 1:
        return "allgather"
    device_type = torch.device(device or "cpu").type
    rate = FLOPS_PER_BYTE.get(device_type, FLOPS_PER_BYTE["cpu"]) if flops_per_byte is None else flops_per_byte
    best, best_cost = "allgather", float("inf")
    for name, algorithm in training().items():
        algorithm = algorithm.for_group(group)
        if algorithm.problem(plan, shapes, group) is not None:
            continue
        credit = OVERLAP_CREDIT if device_type == "cuda" and algorithm.overlaps_compute else 1.0
        received, flops = algorithm.received_bytes(plan, shapes), algorithm.flops(plan, shapes)
        cost = max((b / credit + f / rate for b, f in zip(received, flops, strict=True)), default=0.0)
        if cost < best_cost:
            best, best_cost = name, cost
    return best


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group: Group = None,
              algorithm: str = "auto", scale: float | None = None, return_lse: bool = False, backend: str = "auto"
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact document-masked attention over CP ranks (see module docstring).

    q ``[T_local, Hq, D]``, k/v ``[T_local, Hkv, D]`` (``Hq % Hkv == 0``), the mask is
    ``plan.mask``. ``group``: the CP process group (``None``: the default group), or a
    :class:`doccp.HybridGroup` (the CP group factored into Ulysses groups and the groups across
    them, made once on every process) for ``"hybrid"``. ``algorithm``: one of
    ``doccp.algorithms.training()``: ``"allgather"`` (fetch exactly the KV local queries see),
    ``"ring_kv"`` (KV blocks around the ring), ``"ulysses"`` (all-to-all: every rank attends
    the whole stream on ``Hq / N`` heads; needs ``Hq % N == 0`` and ``Hkv`` dividing or a
    multiple of ``N``), ``"hybrid"`` (Ulysses inside the HybridGroup's Ulysses groups,
    all-gather across them), or ``"auto"`` (:func:`choose_algorithm`). Returns out
    ``[T_local, Hq, D]`` and, with ``return_lse``, lse ``[Hq, T_local]`` in fp32 (not
    differentiable). Bad input, or ranks that disagree on the plan or the call, raise the same
    error on every rank (:mod:`doccp.agreement`).
    """
    problem = attention_problem(q, k, v, plan, group, algorithm, backend, scale)
    agree(problem, group, call_fields(q, k, plan, algorithm, backend, scale, group))
    return run_attention(q, k, v, plan, group, algorithm, scale, return_lse, backend)


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group: Group,
                  algorithm: str, scale: float | None, return_lse: bool, backend: str
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` after its arguments were checked and agreed on."""
    shapes = Shapes.of(q, k)
    name = choose_algorithm(plan, shapes, q.device, group) if algorithm == "auto" else algorithm
    chosen, rank = ALGORITHMS[name].for_group(group), comm.rank(group)
    call = Call(plan, rank, schedule_of(chosen, plan, rank), plan.mask, default_scale(q, scale), backend,
                comm.process_group(group))
    out, lse = CPAttention.apply(q, k, v, chosen, call)
    return (out, lse) if return_lse else out


def call_fields(q: object, k: object, plan: object, algorithm: object, backend: object, scale: object,
                group: Group = None) -> dict[str, object]:
    """What must be equal on every rank of one CP attention call (see :func:`doccp.agreement.agree`)."""
    tensors = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    factored = isinstance(group, HybridGroup) and group.problem() is None
    return {
        "plan": describe_plan(plan) if isinstance(plan, Plan) else None,
        "algorithm": algorithm,
        "backend": backend,
        "heads and head_dim of q and k": (tuple(q.shape[1:]), tuple(k.shape[1:])) if tensors else None,
        "dtype": str(q.dtype) if tensors else None,
        "device type": q.device.type if tensors else None,
        "scale": scale,
        "Ulysses groups": f"{group.across_size} of {group.ulysses_size} ranks" if factored else None,
    }


def attention_problem(q: object, k: object, v: object, plan: object, group: Group,
                      algorithm: object, backend: object, scale: object) -> Exception | None:
    """The first thing wrong with the arguments of a CP attention call on this rank (returned)."""
    problem = first(qkv_problem(q, k, v), scale_problem(scale),
                    choice_problem(algorithm, "algorithm", ["auto", *training()]),
                    choice_problem(backend, "backend", ["auto", *BACKENDS]))
    if problem is not None:
        return problem
    if not isinstance(plan, Plan):
        return TypeError(f"plan must be a doccp.Plan (from doccp.plan(...)), got {type(plan).__name__}")
    problem = comm.check_group(plan.world_size, group) or (group.problem() if isinstance(group, HybridGroup) else None)
    if problem is not None:
        return problem
    me = comm.rank(group)
    expected = plan.local_sizes[me]
    if q.shape[0] != expected:
        return ValueError(f"q, k and v have {q.shape[0]} tokens on rank {me}, but the plan gives this rank "
                          f"{expected}; pass doccp.shard(x, plan, {me})")
    if algorithm != "auto":
        return ALGORITHMS[algorithm].for_group(group).problem(plan, Shapes.of(q, k), group)
    return None
