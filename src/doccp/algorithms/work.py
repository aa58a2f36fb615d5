"""A ring step's work: one or more ``(slices, mask)`` parts against the same q and k/v buffers.

Training needs one part per step (the plan's mask). Inference adds a second one: key rows
whose positions are not consecutive (decoded tokens spread round-robin over ranks) but are
all visible to the queries are attended with :meth:`Mask.full` in one slice, instead of one
slice per token. Parts of the same query rows merge by LSE in fp32 like any partial result.
"""

from __future__ import annotations

import torch

from doccp import kernels
from doccp.device_copies import on_device
from doccp.kernels.runs import Work


def accumulators(q: torch.Tensor, rows: int | None = None, dim: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty fp32 (fp64 for fp64 q) ``out [rows, Hq, dim]`` and ``lse [Hq, rows]`` (0 and -inf)."""
    dtype = accumulators_dtype(q)
    rows = q.shape[0] if rows is None else rows
    out = torch.zeros(rows, q.shape[1], q.shape[2] if dim is None else dim, dtype=dtype, device=q.device)
    return out, torch.full((q.shape[1], rows), float("-inf"), dtype=dtype, device=q.device)


def attend_into(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                work: Work, scale: float, backend: str, finite_kv: bool = False) -> None:
    """Merge every part of ``work`` (q rows vs k/v rows) into the accumulators in place."""
    for slices, mask in work:
        if len(slices):
            kernels.merge_into(out, lse, *kernels.attend(q, k, v, slices, mask, scale, backend, finite_kv))


def attend_work(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, work: Work, scale: float, backend: str,
                finite_kv: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial out/lse of all q rows over ``work`` (rows in no slice: 0 / -inf), in fp32. Work of
    one part is the kernel's own result, upcast: merging it into empty accumulators would give
    the same values (weight exp(0) = 1 on its side, 0 on theirs) for a zero fill and a merge pass.
    ``finite_kv``: k and v are known finite (see :func:`doccp.kernels.attend`)."""
    parts = [(slices, mask) for slices, mask in work if len(slices)]
    if len(parts) == 1:
        out, lse = kernels.attend(q, k, v, *parts[0], scale, backend, finite_kv)
        dtype = accumulators_dtype(q)
        return out.to(dtype), lse.to(dtype)
    out, lse = accumulators(q, dim=v.shape[2])
    attend_into(out, lse, q, k, v, parts, scale, backend, finite_kv)
    return out, lse


def accumulators_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 ``q``: what partial results sum and merge in."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]``: a view (no copy) when the rows are one ascending run, else a gather."""
    n = rows.numel()
    if n and int(rows[-1]) - int(rows[0]) == n - 1 and (n == 1 or bool((rows[1:] - rows[:-1] == 1).all())):
        return x[int(rows[0]):int(rows[0]) + n]
    return x.index_select(0, on_device(rows, x.device))
