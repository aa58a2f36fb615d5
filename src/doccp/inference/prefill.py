"""prefill: new tokens attend to their sequence's cached and new keys, across the CP ranks.

The plan's layout is the *new* tokens (document b = the new part of sequence b, possibly
empty); their absolute positions continue from each sequence's cached length, and the mask
applies to those absolute positions. The new K/V are appended to the cache first (where
the plan put the tokens), so afterwards every rank's keys are simply its cache rows::

    sequence of 10 cached + 6 new tokens, N = 2, causal
    rank 0 cache   0 1 2 3 4 | 10 11 12        queries of rank 0: 10 11 12
    rank 1 cache   5 6 7 8 9 | 13 14 15        queries of rank 1: 13 14 15

    pass_kv: rank 1's rows (cached and new K/V) travel to rank 0, rank 0's to rank 1
    pass_q:  rank 0's queries travel to rank 1; their partial out/lse come back and merge

Each rank's block (what travels) is only what some other rank can see: the keys (pass-KV)
or queries (pass-Q) within the band of another rank's queries (keys) of the same sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from doccp.agreement import agree
from doccp.algorithms import attention_problem, call_fields
from doccp.algorithms.registry import prefilling
from doccp.checks import choice_problem
from doccp.inference.cache import ShardedKVCache
from doccp.inference.heuristic import Calibration, choose_prefill_algorithm
from doccp.kernels import default_scale
from doccp.kernels.runs import Runs
from doccp.plan import Plan
from doccp.ranges import offsets_within


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, cache: ShardedKVCache,
            group: dist.ProcessGroup | None = None, algorithm: str = "auto", scale: float | None = None,
            backend: str = "auto", return_lse: bool = False, calibration: Calibration | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's new tokens over cached + new keys; appends the new KV.

    q ``[T_local, Hq, D]``, k/v ``[T_local, Hkv, D]`` are this rank's shards of the new tokens
    (``doccp.shard(x, plan, rank)``); ``plan.layout`` has one document per sequence of the
    cache (zero-length for sequences without new tokens) and ``plan.mask`` is the mask. With
    an empty cache this is a full prefill. ``algorithm``: ``"pass_kv"``, ``"pass_q"`` or
    ``"auto"`` (:func:`choose_prefill_algorithm`, from ``calibration``; without one, the first
    ``auto`` prefill on a group runs :func:`~doccp.inference.calibrate`, a collective
    micro-benchmark of the group cached for later calls). Returns out ``[T_local, Hq, D]`` and,
    with ``return_lse``, lse ``[Hq, T_local]`` (fp32). Bad input raises the same error on every rank.
    """
    problem = _problem(q, k, v, plan, cache, group, algorithm, backend, scale)
    fields = call_fields(q, k, plan, algorithm, backend, scale)
    fields["the KV cache"] = cache.describe() if isinstance(cache, ShardedKVCache) else None
    agree(problem, group, fields)
    n = plan.world_size
    offset = cache.lengths if cache.num_seqs is not None else torch.zeros(plan.layout.num_docs, dtype=torch.int64)
    if algorithm == "auto":
        new = plan.layout.lengths
        algorithm = choose_prefill_algorithm(int(new.sum()), int(offset[new > 0].sum()), n, q.shape[1], k.shape[1],
                                             dtype=q.dtype, head_dim=q.shape[2], calibration=calibration, group=group,
                                             device=q.device)
    cache.append(k, v, plan)
    p = plan.all_pieces
    queries = Runs(p.rank, p.doc, offsets_within(p.rank, p.length), offset[p.doc] + p.start, p.length,
                   torch.ones_like(p.doc))
    out, lse = prefilling()[algorithm].prefill(q, cache, queries, default_scale(q, scale), backend, group)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def _problem(q, k, v, plan, cache, group, algorithm, backend, scale) -> BaseException | None:
    """The first thing wrong with the arguments on this rank (returned, not raised)."""
    problem = attention_problem(q, k, v, plan, group, "auto", backend, scale)  # (the training algorithm unused)
    if problem is not None:
        return problem
    if not isinstance(cache, ShardedKVCache):
        return TypeError(f"cache must be a doccp.ShardedKVCache, got {type(cache).__name__}")
    problem = choice_problem(algorithm, "algorithm", ["auto", *prefilling()])
    if problem is not None:
        return problem
    if plan.mask.looks_ahead:
        return ValueError(f"prefill needs a mask that never looks ahead (causal, sliding_window(w) or chunked(s)), got "
                          f"{plan.mask}: a token cannot attend to tokens generated after it")
    return cache.problem(group, k, plan)
