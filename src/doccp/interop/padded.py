"""Context parallelism for a padded batch ``[B, L, ...]`` holding one document per row.

Every rank keeps the head-tail pieces of every document (chunks ``r`` and ``2N-1-r`` of
``2N``, see :mod:`doccp.plan.head_tail`), concatenated per row and padded to the longest
local row of any rank, so the local tensor has the same shape ``[B, max_local, ...]`` on
every rank::

    doc_lens [16, 12, 18], N = 2           rank 0                 rank 1
    row 0 (16): chunks 4 4 4 4             0..3 + 12..15          4..11
    row 1 (12): chunks 3 3 3 3             0..2 +  9..11          3..8
    row 2 (18): chunks 5 5 4 4             0..4 + 14..17          5..13
    local                                  [3, 9, ...], [8, 6, 9] [3, 9, ...], [8, 6, 9]

Inside, the local padded tensor is just another view of the rank's THD shard of a
head-tail :class:`~doccp.plan.Plan`, so :func:`padded_attention` is exact CP attention
(queries see their whole document, wherever its keys live), not attention within the
rank's own tokens.
"""

from __future__ import annotations

from functools import cached_property, lru_cache
from typing import NamedTuple

import torch
import torch.distributed as dist

from doccp import comm
from doccp.agreement import agree, describe_plan
from doccp.layout import DocLayout, IntsLike, as_int_tensor
from doccp.masks import Mask
from doccp.plan import Plan, plan
from doccp.shard import unshard

__all__ = ["PaddedShard", "PaddedPlan", "padded_plan", "shard_padded", "unshard_padded", "padded_attention"]


class PaddedShard(NamedTuple):
    """One rank's part of a padded batch."""

    #: ``[B, max_local, ...]``: the rank's tokens of every row, left-aligned, zero-padded.
    x: torch.Tensor
    #: ``[B]`` int64: how many tokens of each row the rank holds.
    lengths: torch.Tensor


class PaddedPlan:
    """A head-tail :class:`Plan` for one document per row, plus the maps between a rank's
    padded local tensor ``[B, max_local, ...]`` and its THD shard ``[T_local, ...]``."""

    def __init__(self, doc_lens: tuple[int, ...], world_size: int, mask: Mask):
        self.doc_lens = doc_lens
        self.plan: Plan = plan(DocLayout.from_lengths(doc_lens), world_size, mask, strategy="head_tail")

    @property
    def batch(self) -> int:
        return len(self.doc_lens)

    @cached_property
    def _local_layouts(self) -> list[DocLayout]:
        b = self.batch
        lens = [torch.bincount(self.plan.doc_ids(r), minlength=b) for r in range(self.plan.world_size)]
        longest = max((int(x.max()) for x in lens if x.numel()), default=0)
        return [DocLayout.from_padded(x, longest) for x in lens]

    @property
    def max_local(self) -> int:
        """Padded local row length, the same on every rank."""
        return self._local_layouts[0].rows[1]  # type: ignore[index]

    def local_layout(self, rank: int) -> DocLayout:
        """The rank's local rows as a padded layout: ``pack_padded`` gives its THD shard."""
        self.plan.check_rank(rank)
        return self._local_layouts[rank]

    def source_index(self, rank: int, row_len: int) -> torch.Tensor:
        """Flat index into ``[B * row_len]`` of each token of the rank's THD shard."""
        return self.plan.doc_ids(rank) * row_len + self.plan.positions(rank)

    def positions(self, rank: int) -> torch.Tensor:
        """``[B, max_local]`` document position of every local slot (for RoPE; 0 in padding)."""
        return self.local_layout(rank).unpack_padded(self.plan.positions(rank))


def padded_plan(doc_lens: IntsLike, world_size: int, mask: Mask | None = None) -> PaddedPlan:
    """The (cached) head-tail plan of a padded batch; cheap to call every step."""
    lens = as_int_tensor(doc_lens, "doc_lens")
    if (lens < 0).any():
        raise ValueError(f"doc_lens must be >= 0, got {lens.tolist()[:8]}")
    return _cached_plan(tuple(lens.tolist()), world_size, Mask.causal() if mask is None else mask)


@lru_cache(maxsize=64)
def _cached_plan(doc_lens: tuple[int, ...], world_size: int, mask: Mask) -> PaddedPlan:
    # Reusing one Plan object per batch shape also lets collective validation run once.
    return PaddedPlan(doc_lens, world_size, mask)


def shard_padded(x: torch.Tensor, doc_lens: IntsLike, rank: int, world_size: int) -> PaddedShard:
    """The head-tail pieces of every row of ``x`` (``[B, L, ...]``) that ``rank`` holds.

    Returns ``PaddedShard(x_local, lengths)``: ``x_local`` is ``[B, max_local, ...]`` (rows
    left-aligned, zero padding), ``lengths`` ``[B]`` the rank's tokens per row. Needs no
    process group. Differentiable: the gradient lands on the positions the rank took, zeros
    elsewhere.
    """
    pp = padded_plan(doc_lens, world_size)
    problem = _problem(x, "x", pp.batch, max(pp.doc_lens, default=0), exact=False)
    if problem is not None:
        raise problem
    lay = pp.local_layout(rank)
    row_len = x.shape[1]
    tokens = x.reshape(pp.batch * row_len, *x.shape[2:]).index_select(0, pp.source_index(rank, row_len).to(x.device))
    return PaddedShard(lay.unpack_padded(tokens), lay.lengths)


def unshard_padded(x_local: torch.Tensor, doc_lens: IntsLike, max_len: int | None = None,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_padded` over ``group``: every rank gets ``[B, max_len, ...]``.

    ``max_len`` defaults to ``max(doc_lens)``; padding is zero. Like :func:`doccp.unshard`,
    the backward returns the rank's own part of the gradient (right when every rank computes
    the same function of the result).
    """
    pp, problem = _padded_plan_or_problem(doc_lens, group, None)
    longest = max(pp.doc_lens, default=0) if pp is not None else 0
    max_len = longest if max_len is None else max_len
    if problem is None:
        problem = _problem(x_local, "x_local", pp.batch, pp.max_local)
    if problem is None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < longest):
        problem = ValueError(f"max_len must be an int >= max(doc_lens)={longest}, got {max_len!r}")
    agree(problem, group, {"plan": pp and describe_plan(pp.plan), "max_len": max_len,
                           "x_local shape": _shape(x_local), "dtype": getattr(x_local, "dtype", None)})
    local = pp.local_layout(comm.rank(group)).pack_padded(x_local)
    stream = local if pp.plan.world_size == 1 else unshard(local, pp.plan, group)  # one rank: already in order
    return DocLayout.from_padded(pp.doc_lens, max_len).unpack_padded(stream)


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens: IntsLike,
                     group: dist.ProcessGroup | None = None, mask: Mask | None = None,
                     scale: float | None = None, return_lse: bool = False, algorithm: str = "auto",
                     backend: str = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact CP attention over the padded local shards from :func:`shard_padded`.

    q ``[B, max_local, Hq, D]``, k/v ``[B, max_local, Hkv, D]`` (or ``[B, max_local, D]``
    for one head), ``doc_lens`` the full length of every row (the same on every rank),
    ``mask`` causal by default. Returns the local output ``[B, max_local, Hq, D]`` (zero in
    padding) and, with ``return_lse``, the fp32 log-sum-exp ``[B, max_local, Hq]``
    (``-inf`` in padding).
    """
    from doccp.algorithms import attention_problem, call_fields, run_attention

    pp, problem = _padded_plan_or_problem(doc_lens, group, mask)
    for name, t in (("q", q), ("k", k), ("v", v)):
        problem = problem or _problem(t, name, pp.batch, pp.max_local, ndims=(3, 4))
    if problem is None and not q.dim() == k.dim() == v.dim():
        problem = ValueError(f"q, k and v must all be 3-D or all 4-D, got {q.dim()}, {k.dim()}, {v.dim()}")
    one_head = problem is None and q.dim() == 3
    if one_head:
        q, k, v = (t.unsqueeze(2) for t in (q, k, v))
    packed = (q, k, v)
    if problem is None:  # the rank's THD shard: checked like any doccp.attention call
        lay = pp.local_layout(comm.rank(group))
        packed = tuple(lay.pack_padded(t) for t in (q, k, v))
        problem = attention_problem(*packed, pp.plan, group, algorithm, backend, scale)
    agree(problem, group, call_fields(packed[0], packed[1], pp and pp.plan, algorithm, backend, scale))
    result = run_attention(*packed, pp.plan, group, algorithm, scale, return_lse, backend)
    out, lse = result if return_lse else (result, None)
    out = lay.unpack_padded(out)
    if lse is None:
        return out.squeeze(2) if one_head else out
    lse = lay.unpack_padded(lse.transpose(0, 1), fill=float("-inf"))
    return (out.squeeze(2), lse.squeeze(2)) if one_head else (out, lse)


def _padded_plan_or_problem(doc_lens: object, group: dist.ProcessGroup | None, mask: Mask | None
                            ) -> tuple[PaddedPlan | None, BaseException | None]:
    """The padded plan for the group, or why there is none (returned, so ranks can agree on it)."""
    try:
        return padded_plan(doc_lens, comm.size(group), mask), None
    except (ValueError, TypeError) as e:
        return None, e


def _shape(x: object) -> tuple[int, ...] | None:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def _problem(x: object, name: str, batch: int, row_len: int, ndims: tuple[int, ...] = (), exact: bool = True
             ) -> BaseException | None:
    """Why ``x`` is not a ``[batch, row_len, ...]`` tensor (``>= row_len`` unless exact), or None."""
    if not isinstance(x, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndims and x.dim() not in ndims:
        return ValueError(f"{name} must be {' or '.join(f'{d}-D' for d in ndims)} ([B, L, H, D] or [B, L, D]), "
                          f"got shape {tuple(x.shape)}")
    if x.dim() < 2 or x.shape[0] != batch or (x.shape[1] != row_len if exact else x.shape[1] < row_len):
        want = f"[{batch}, {row_len}, ...]" if exact else f"[{batch}, L >= {row_len}, ...]"
        hint = " (the output of doccp.shard_padded for these doc_lens)" if exact else " (one row per document)"
        return ValueError(f"{name} must have shape {want}{hint}, got {tuple(x.shape)}")
    return None

