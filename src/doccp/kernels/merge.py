"""Log-sum-exp merging of partial attention results over the same query rows (fp32).

``lse = logaddexp(lse_a, lse_b)``; ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.
Empty sides (``lse = -inf``) contribute nothing and never produce NaN.
"""

from __future__ import annotations

import torch


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results; ``out`` is ``[T, H, D]``, ``lse`` is ``[H, T]``. Returns fp32
    (float64 stays float64)."""
    dtype = torch.float64 if torch.float64 in (out_a.dtype, out_b.dtype) else torch.float32
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).T.unsqueeze(-1)  # [T, H, 1]; exp(-inf) = 0
    wb = torch.exp(lse_b - safe).T.unsqueeze(-1)
    return out_a.to(dtype) * wa + out_b.to(dtype) * wb, lse


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               rows: slice | torch.Tensor | None = None) -> None:
    """In-place ``acc[rows] <- merge(acc[rows], part)`` for fp32/fp64 accumulators."""
    if rows is None:
        rows = slice(None)
    new_out, new_lse = merge(acc_out[rows], acc_lse[:, rows], out, lse)
    acc_out[rows] = new_out
    acc_lse[:, rows] = new_lse


def merge_rows(rows: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, num_rows: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """N-way LSE merge of partial results ``out [P, H, D]``, ``lse [P, H]`` landing on
    ``rows [P]`` (repeats allowed) -> ``out [num_rows, H, D]``, ``lse [num_rows, H]`` in fp32
    (fp64 stays fp64). Rows no part lands on get 0 and -inf; never NaN."""
    dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    lse = lse.to(dtype)
    h = lse.shape[1]
    peak = torch.full((num_rows, h), float("-inf"), dtype=dtype, device=out.device)
    peak.scatter_reduce_(0, rows[:, None].expand(-1, h), lse, "amax")
    peak = peak.nan_to_num(neginf=0.0)  # rows/heads without a finite part: weight exp(-inf) = 0
    weight = torch.exp(lse - peak[rows])
    total = torch.zeros_like(peak).index_add_(0, rows, weight)
    merged_lse = peak + torch.log(total)  # log(0) = -inf where nothing landed
    weight = (weight / total.clamp(min=torch.finfo(dtype).tiny)[rows]).unsqueeze(-1)
    merged = torch.zeros(num_rows, h, out.shape[-1], dtype=dtype, device=out.device)
    merged.index_add_(0, rows, out.to(dtype) * weight)
    return merged, merged_lse
