"""One rule for NaN and inf inputs, whatever the backend: they poison exactly the rows that see them.

A query row (one head) whose q is not finite, or that sees (under the slices and the mask) a
key whose k or v is not finite in its KV head, gets ``out = NaN`` and ``lse = NaN``; every
other row keeps its exact result, so a NaN never leaks into another document, nor into a row
that does not see it. Kernels differ here on their own (PyTorch's CPU flash kernel returns 0
with lse 0 for a NaN query; plain math gives NaN, or a finite result when a key is ``-inf``, and
multiplies masked-out ``inf`` values by 0 into NaN for rows that never see them), so for CPU
tensors :func:`doccp.kernels.attend` runs the backend on zeroed copies and then poisons the rows
that see a non-finite input; the backward runs on the same zeroed copies, so its NaN spreads from
the poisoned rows (through their out and lse) to what they touched, and nowhere else. The cost,
when every input is finite, is one min/max pass over q, k and v (:func:`all_finite`).
"""

from __future__ import annotations

import torch

from doccp.kernels.slices import Slices
from doccp.masks import BandMask
from doccp.ranges import repeat, starts


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element is finite, by one min/max reduction per tensor: ``aminmax`` propagates
    NaN, and an infinity is its own tensor's min or max. On CPU ``isfinite(t).all()`` first writes a
    bool tensor as large as ``t``: 15x slower (50 ms against 3 ms for 8M floats, one thread)."""
    for t in tensors:
        if t.numel():
            lo, hi = torch.aminmax(t)
            if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                return False
    return True


def zeroed(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies with every NaN and inf replaced by 0 (what the kernels compute the clean rows from)."""
    return [torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in tensors]


def poison(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           slices: Slices, mask: BandMask) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [Tq, Hq, D]`` and ``lse [Hq, Tq]`` with NaN in the rows that see a non-finite input."""
    hq, hkv = q.shape[1], k.shape[1]
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [Tk, Hkv]
    seen_bad = torch.cat([bad_kv.new_zeros(1, hkv, dtype=torch.int64), bad_kv.long().cumsum(0)])
    heights = (slices.q_end - slices.q_start).clamp(min=0)
    which = repeat(torch.arange(len(slices)), heights)
    within = torch.arange(which.numel()) - starts(heights)[which]
    row = slices.q_start[which] + within
    # keys of the slice that row `within` sees: document positions [pos - left, pos + right]
    offset = slices.q_pos0[which] + within - slices.k_pos0[which] + slices.k_start[which]
    lo = torch.clamp(offset - mask.left_bound, min=slices.k_start[which])
    hi = torch.minimum(offset + mask.right_bound + 1, slices.k_end[which]).clamp(min=lo)
    sees = (hi > lo)[:, None]
    hits = (seen_bad[hi] - seen_bad[lo]) > 0  # [rows, Hkv]
    bad_rows = hits.repeat_interleave(hq // hkv, 1) | (~torch.isfinite(q[row]).all(-1) & sees)
    bad = torch.zeros(q.shape[0], hq, dtype=torch.bool).index_put_((row,), bad_rows, accumulate=True)
    nan = float("nan")
    return out.masked_fill(bad[..., None], nan), lse.masked_fill(bad.T, nan)
