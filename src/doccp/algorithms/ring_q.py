"""Ring pass-Q: the queries travel and the keys stay; partial results go home at the end.

Cheap when few new queries meet a large KV cache (the KV would be the bigger message). At
step t rank r attends the query block of rank r - t to its own keys; after the last step
every rank sends each partial ``(out, lse)`` back to the queries' owner in one all-to-all,
where they merge by LSE with the owner's own step-0 result::

    N = 3                 step 0      step 1      step 2      all-to-all
    rank 0 computes       q0 x kv0    q2 x kv0    q1 x kv0    q2 part -> rank 2, q1 part -> rank 1
    rank 1 computes       q1 x kv1    q0 x kv1    q2 x kv1    ...
    rank 2 computes       q2 x kv2    q1 x kv2    q0 x kv2    ...

Decode is the same pattern without hops (every rank already holds every query):
:func:`exchange_partials` is the all-to-all both use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from doccp import comm, kernels
from doccp.algorithms.registry import Algorithm, register
from doccp.algorithms.work import attend_work, take_rows
from doccp.device_copies import on_device
from doccp.kernels.runs import Runs, Work, clip_to_others, queries_seeing, work


def exchange_partials(parts: list[tuple[torch.Tensor, torch.Tensor] | None], recv_rows: list[int],
                      like: torch.Tensor, group: dist.ProcessGroup | None = None
                      ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Send ``parts[p]`` (partial out ``[rows, H, D]``, lse ``[H, rows]``) to rank p and receive
    ``recv_rows[p]`` partial rows from it. Out and lse travel as one tensor of ``like``'s dtype
    (the fp32 accumulator) and shape ``[rows, H, D + 1]``; empty parts are skipped."""
    if comm.size(group) == 1:
        return [None] * len(parts)
    h, d = like.shape[1], like.shape[2]
    sends = [None if p is None else torch.cat([p[0], p[1].T.unsqueeze(-1)], -1) for p in parts]
    shapes = [(rows, h, d + 1) for rows in recv_rows]
    received = comm.exchange(sends, shapes, like, group)
    return [None if x is None else (x[..., :d], x[..., d].T) for x in received]


def ring_pass_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, own_block_rows: torch.Tensor,
                block_sizes: list[int], steps: list[Work], scale: float, backend: str,
                group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged fp32 out/lse of the local queries ``q`` over every rank's keys.

    ``k``/``v`` are this rank's keys; ``q[own_block_rows]`` is the query block this rank sends
    around the ring and ``block_sizes[r]`` the rows of rank r's block. ``steps[0]`` is the
    work of all local queries against ``k``/``v``; ``steps[t]`` that of rank ``me - t``'s block.
    """
    me, n = comm.rank(group), comm.size(group)
    block = take_rows(q, own_block_rows)
    partials: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n
    out = lse = None
    for t in range(n):
        shape = (block_sizes[(me - t - 1) % n], *q.shape[1:])
        hop = comm.RingStep([block], [shape], [q], group) if t < n - 1 else None
        if t == 0:
            out, lse = attend_work(q, k, v, steps[0], scale, backend)
        elif block.shape[0]:
            partials[(me - t) % n] = attend_work(block, k, v, steps[t], scale, backend)
        if hop is not None:
            block = hop.wait()[0]
    rows = on_device(own_block_rows, q.device)
    for part in exchange_partials(partials, [block_sizes[me]] * n, out, group):
        if part is not None:
            kernels.merge_into(out, lse, *part, rows=rows)
    return out, lse


class RingQ(Algorithm):
    name = "ring_q"
    summary = "queries travel the ring to the KV they see, partial results come home (prefill on a long cache)"
    prefill_name = "pass_q"
    trains = False
    overlaps_compute = True

    def prefill(self, q, cache, queries: Runs, scale, backend, group):
        """Pass-Q over a KV cache: each rank's block is its new queries that some other rank's
        cached keys can serve (within the mask's reach of their hull), sent around the ring."""
        me, n, mask, seqs = cache.rank, cache.world_size, cache.mask, cache.num_seqs
        keys = cache.runs
        lo, hi = queries_seeing(mask, *keys.hull(n * seqs, keys.rank * seqs + keys.doc))
        blocks = [clip_to_others(queries.select(queries.rank == s), lo, hi, s, n) for s in range(n)]
        local, own_keys = queries.select(queries.rank == me), cache.local_runs()
        steps = [work(local, own_keys, mask)]
        steps += [work(blocks[(me - t) % n].packed(), own_keys, mask) for t in range(1, n)]
        sizes = [int(b.length.sum()) for b in blocks]
        return ring_pass_q(q, cache.k, cache.v, blocks[me].rows(), sizes, steps, scale, backend, group)


register(RingQ())
