"""Kernels: ``attend(q, k, v, slices, mask, scale) -> out, lse`` and its backward, per backend.

Backends: ``reference`` (plain PyTorch, float64-capable, the oracle), ``cpu`` (PyTorch's CPU
flash kernel), ``cuda`` (flash varlen). ``auto`` picks the best one for the tensors' device.
Shapes: q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` with ``Hq % Hkv == 0``; out ``[Tq, Hq, D]``
in q's dtype, lse ``[Hq, Tq]`` in fp32 (fp64 for fp64 inputs). The backward takes the
*final* (merged) out and lse, so a distributed backward never recomputes the forward.
Backends see band masks only (:class:`~doccp.masks.BandMask`); :func:`attend` rewrites the
slices of any other mask into band parts (:meth:`~doccp.masks.Mask.bands`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from doccp.kernels import cpu, cuda, nonfinite, reference
from doccp.kernels.merge import merge, merge_into
from doccp.kernels.slices import Slices, doc_slices, pair_slices
from doccp.masks import Mask

__all__ = ["attend", "attend_backward", "merge", "merge_into", "Slices", "doc_slices", "pair_slices",
           "BACKENDS", "resolve_backend", "default_scale"]

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

#: name -> (forward, backward). ``cuda`` is registered only where CUDA and flash varlen exist.
BACKENDS: dict[str, tuple[Forward, Backward]] = {
    "reference": (reference.attend, reference.attend_backward),
    "cpu": (cpu.attend, cpu.attend_backward),
}
if cuda.available():
    BACKENDS["cuda"] = (cuda.attend, cuda.attend_backward)


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """``auto`` -> the best backend registered for ``q``'s device and dtype: ``cuda`` for
    fp16/bf16 CUDA tensors, ``cpu`` for CPU tensors, ``reference`` for float64 and for what
    neither covers (fp32 on CUDA: flash attention has no fp32 kernel)."""
    if backend == "auto":
        if q.dtype == torch.float64:
            return "reference"
        if q.is_cuda and "cuda" in BACKENDS and q.dtype in cuda.DTYPES:
            return "cuda"
        if q.device.type == "cpu" and "cpu" in BACKENDS:
            return "cpu"
        return "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    return backend


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slices: Slices, mask: Mask,
           scale: float | None = None, backend: str = "auto", finite_kv: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of the query rows over the slices; rows in no slice get 0 / -inf.

    The backends know band masks only: any other mask first rewrites the slices as band-masked
    parts (:meth:`Mask.bands`), whose partial results merge by log-sum-exp. Any strides are
    fine (a tensor whose last dimension is not dense is copied once). On CPU tensors, NaN/inf
    inputs poison exactly the rows that see them (:mod:`.nonfinite`); ``finite_kv`` says the caller
    knows every element of k and v is finite (a KV cache that checked its rows as they were written),
    so only q is checked: a decode step's keys are the whole cache, its queries one row per sequence."""
    q, k, v = dense_last(q), dense_last(k), dense_last(v)
    forward, scale = BACKENDS[resolve_backend(backend, q)][0], default_scale(q, scale)
    parts = mask.bands(slices)
    # (on a GPU the check would sync)
    poisoned = q.device.type == "cpu" and not nonfinite.all_finite(*((q,) if finite_kv else (q, k, v)))
    inputs = nonfinite.zeroed(q, k, v) if poisoned else (q, k, v)
    out, lse = forward(*inputs, *parts[0], scale)
    for part_slices, band in parts[1:]:
        out, lse = merge(out, lse, *forward(*inputs, part_slices, band, scale))
        out = out.to(q.dtype)
    for part_slices, band in parts if poisoned else ():
        out, lse = nonfinite.poison(out, lse, q, k, v, part_slices, band)
    return out, lse


def attend_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, slices: Slices, mask: Mask,
                    scale: float | None = None, backend: str = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the slices' contribution, given the final out and lse of the rows (summed
    over the band parts of the mask, like the forward)."""
    dout, q, k, v, out = (dense_last(x) for x in (dout, q, k, v, out))
    if q.device.type == "cpu" and not nonfinite.all_finite(q, k, v):  # poisoned rows carry NaN in out/lse
        q, k, v = nonfinite.zeroed(q, k, v)
    backward, scale = BACKENDS[resolve_backend(backend, q)][1], default_scale(q, scale)
    parts = mask.bands(slices)
    grads = backward(dout, q, k, v, out, lse, *parts[0], scale)
    for part_slices, band in parts[1:]:
        grads = tuple(a + b for a, b in zip(grads, backward(dout, q, k, v, out, lse, part_slices, band, scale),
                                            strict=True))
    return grads


def dense_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension is dense (what every kernel needs), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
