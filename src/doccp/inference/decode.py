"""decode: one new token per sequence, attending to the sequence's KV spread over all ranks.

Every rank holds every sequence's new query (the model's other layers run on the whole
batch); each rank attends all of them to its own part of the cache, then the partial
``(out, lse)`` of sequence b go to its *owner*, rank ``b % N``, and merge there (the paper's
pass-Q decode: no hop, one all-to-all). The new token's KV is cached first, on rank
``(b + step) % N`` (round-robin), so it attends to itself::

    B = 5, N = 2        rank 0 returns sequences 0, 2, 4  (= q[0::2])
                        rank 1 returns sequences 1, 3     (= q[1::2])
    gather=True: every rank gets all 5, in sequence order (one more all-gather)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from doccp import comm, kernels
from doccp.agreement import agree
from doccp.algorithms.ring_q import exchange_partials
from doccp.algorithms.work import Work, attend_work
from doccp.checks import choice_problem, first, qkv_problem, scale_problem
from doccp.inference.cache import ShardedKVCache
from doccp.kernels import BACKENDS, default_scale
from doccp.kernels.runs import Runs, work
from doccp.kernels.slices import Slices
from doccp.masks import Mask


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: ShardedKVCache,
           group: dist.ProcessGroup | None = None, gather: bool = False, scale: float | None = None,
           backend: str = "auto", return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One decode step of every cached sequence; appends the new KV to the cache.

    q ``[B, Hq, D]``, k/v ``[B, Hkv, D]``: one new token per sequence, the same on every rank;
    the token of sequence b sits at position ``cache.lengths[b]`` and sees its cached tokens
    under the cache's mask. Returns the owned rows ``out [len(range(rank, B, N)), Hq, D]``
    (sequences ``rank, rank + N, ...``), or with ``gather=True`` all ``[B, Hq, D]`` on every
    rank; with ``return_lse`` also lse ``[Hq, rows]`` (fp32). Bad input raises on every rank.
    """
    me = comm.rank(group)
    problem = _problem(q, k, v, cache, group, backend, scale)
    tensors = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    agree(problem, group, {
        "the KV cache": cache.describe() if isinstance(cache, ShardedKVCache) else None,
        "q and k shapes": (tuple(q.shape), tuple(k.shape)) if tensors else None,
        "dtype": str(q.dtype) if tensors else None,
        "backend": backend,
        "scale": scale,
    })
    n, seqs = cache.world_size, cache.num_seqs
    pos = cache.append_decoded(k, v)
    every = torch.arange(seqs)
    queries = Runs.of(me, every, every, pos, 1, 1)
    out, lse = _attend_grouped(q, cache, work(queries, cache.local_runs(), cache.mask), default_scale(q, scale),
                               backend)
    owner = every % n
    mine = owner == me
    parts = [None if p == me else (out[owner == p], lse[:, owner == p]) for p in range(n)]
    out, lse = out[mine], lse[:, mine]
    for part in exchange_partials(parts, [int(mine.sum())] * n, out, group):
        if part is not None:
            kernels.merge_into(out, lse, *part)
    if gather and n > 1:
        sizes = torch.bincount(owner, minlength=n).tolist()
        packed = torch.cat([out, lse.T.unsqueeze(-1)], -1)
        full = packed.new_empty(seqs, *packed.shape[1:])
        for p, rows in enumerate(comm.all_gather_varsize(packed, sizes, group)):
            full[owner == p] = rows
        out, lse = full[..., :-1], full[..., -1].T.contiguous()
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def _attend_grouped(q: torch.Tensor, cache: ShardedKVCache, parts: Work, scale: float, backend: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial out/lse of one query row per sequence, with the G = Hq/Hkv query heads that
    share a KV head folded into G query rows: the kernel then reads each key once per KV
    head instead of once per query head. Exact because every slice was trimmed to what its
    single query sees, so all of them run unmasked."""
    b, hq, d = q.shape
    hkv = cache.k.shape[1]
    g = hq // hkv
    rows = q.view(b, hkv, g, d).transpose(1, 2).reshape(b * g, hkv, d)  # row b*g + i: head h*g + i
    slices = Slices.cat([s for s, _ in parts])
    grouped = Slices(slices.q_start * g, slices.q_end * g, slices.k_start, slices.k_end, slices.q_pos0,
                     slices.k_pos0)
    out, lse = attend_work(rows, cache.k, cache.v, [(grouped, Mask.full())], scale, backend, finite_kv=cache.finite)
    out = out.view(b, g, hkv, d).transpose(1, 2).reshape(b, hq, d)
    return out, lse.view(hkv, b, g).transpose(1, 2).reshape(hq, b)


def _problem(q, k, v, cache, group, backend, scale) -> BaseException | None:
    """The first thing wrong with the arguments on this rank (returned, not raised)."""
    if not isinstance(cache, ShardedKVCache):
        return TypeError(f"cache must be a doccp.ShardedKVCache, got {type(cache).__name__}")
    problem = first(cache.problem(group), qkv_problem(q, k, v), scale_problem(scale),
                    choice_problem(backend, "backend", ["auto", *BACKENDS]))
    if problem is not None:
        return problem
    if cache.num_seqs is None:
        return ValueError("decode before prefill: the KV cache holds no sequences yet; call doccp.prefill(...) "
                          "with the prompts first")
    if q.shape[0] != cache.num_seqs:
        return ValueError(f"sequence count mismatch: q has {q.shape[0]} rows (one new token per sequence) but the "
                          f"cache holds {cache.num_seqs} sequences")
    if cache.mask.looks_ahead:
        return ValueError(f"decode needs a mask that never looks ahead (causal, sliding_window(w) or chunked(s)), "
                          f"but the cache was filled under {cache.mask}")
    return cache.fit_problem(k)
