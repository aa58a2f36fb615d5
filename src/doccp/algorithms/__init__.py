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
from doccp.algorithms.allgather import AllGatherAttention
from doccp.algorithms.ring_kv import RingKVAttention
from doccp.algorithms.schedule import schedule
from doccp.checks import choice_problem, first, qkv_problem, scale_problem
from doccp.kernels import BACKENDS, default_scale
from doccp.plan import Plan

ALGORITHMS = {"allgather": AllGatherAttention, "ring_kv": RingKVAttention}

#: ``auto`` picks the ring while it moves at most this many times the all-gather's bytes.
RING_VOLUME_RATIO = 1.5


def predicted_kv_tokens(plan: Plan, algorithm: str) -> list[int]:
    """KV rows each rank receives in the forward pass (double it for K and V, and again for
    the backward's return trip)."""
    if algorithm == "allgather":
        return plan.exchange.tokens_received(plan.world_size).tolist()
    sizes = schedule(plan, 0, "ring_kv").block_sizes  # every other rank's block visits each rank
    return [sum(sizes) - own for own in sizes]


def choose_algorithm(plan: Plan, device: torch.device | str | None = None) -> str:
    """The ``auto`` rule: all-gather moves the minimal bytes but all before compute; the ring
    moves every block to every rank but hides each hop behind a step's compute. Pick the
    ring when its volume is at most ``RING_VOLUME_RATIO`` x the all-gather's (so the overlap
    pays for the extra bytes) and there is anything to move at all; else all-gather.

    On CPU (gloo) a hop does not overlap compute (bench/cp.py, bench/inference.py; docs/benchmarks.md),
    so the all-gather is always at least as fast there and is chosen."""
    ag = max(predicted_kv_tokens(plan, "allgather"), default=0)
    if plan.world_size == 1 or ag == 0 or torch.device(device or "cpu").type == "cpu":
        return "allgather"
    ring = max(predicted_kv_tokens(plan, "ring_kv"))
    return "ring_kv" if ring <= RING_VOLUME_RATIO * ag else "allgather"


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
    if algorithm == "auto":
        algorithm = choose_algorithm(plan, q.device)
    sched = schedule(plan, comm.rank(group), algorithm)
    out, lse = ALGORITHMS[algorithm].apply(q, k, v, sched, plan.mask, default_scale(q, scale), backend, group)
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
                    choice_problem(algorithm, "algorithm", ["auto", *ALGORITHMS]),
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
    return None
