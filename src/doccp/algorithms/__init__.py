"""Exact context-parallel attention: :func:`attention` and the algorithms behind it.

On every rank q/k/v are that rank's shards (``doccp.shard(x, plan, rank)``); the result on
rank r equals ``shard(varlen_attention(q_full, k_full, v_full, plan.layout, plan.mask), plan, r)``
and gradients flow to the local q/k/v exactly as through the single-device call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from doccp import comm
from doccp.algorithms.allgather import AllGatherAttention
from doccp.algorithms.ring_kv import RingKVAttention
from doccp.algorithms.schedule import schedule
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

    On CPU (gloo) a hop does not overlap compute (measured: bench/cp.py, bench/inference.py),
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
    lse ``[Hq, T_local]`` in fp32 (not differentiable). Bad input raises the same error on
    every rank of ``group``.
    """
    me = comm.rank(group)
    problem = _problem(q, k, v, plan, group, algorithm, backend, me)
    key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, algorithm, backend)
    comm.agree(problem, group, owner=plan, key=key)
    if algorithm == "auto":
        algorithm = choose_algorithm(plan, q.device)
    sched = schedule(plan, me, algorithm)
    out, lse = ALGORITHMS[algorithm].apply(q, k, v, sched, plan.mask, default_scale(q, scale), backend, group)
    return (out, lse) if return_lse else out


def _problem(q, k, v, plan, group, algorithm, backend, me) -> BaseException | None:
    """The first thing wrong with the arguments on this rank (returned, not raised)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            return ValueError(f"{name} must be [T_local, heads, head_dim] (THD), got shape {tuple(t.shape)}")
    if not isinstance(plan, Plan):
        return TypeError(f"plan must be a doccp.Plan (from doccp.plan(...)), got {type(plan).__name__}")
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        return ValueError(f"algorithm must be 'auto' or one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    if backend != "auto" and backend not in BACKENDS:
        return ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    problem = comm.check_group(plan.world_size, group)
    if problem is not None:
        return problem
    if not (q.device == k.device == v.device):
        return ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        return TypeError(f"q, k and v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        return ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        return ValueError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return ValueError(f"the number of query heads ({q.shape[1]}) must be a multiple of the number of "
                          f"KV heads ({k.shape[1]}) for grouped-query attention")
    expected = plan.local_sizes[me]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != expected:
            return ValueError(f"{name} has {t.shape[0]} tokens on rank {me}, but the plan gives this rank "
                              f"{expected}; pass doccp.shard(x, plan, {me})")
    return None
