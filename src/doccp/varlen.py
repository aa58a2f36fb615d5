"""Single-device exact attention over a packed stream of documents (THD layout).

``varlen_attention(q, k, v, layout)`` is the one-call answer to "attention within each
document, never across": one slice per document, handed to the kernel backend, with an
autograd backward that reuses the forward's out and lse (no recompute)::

    layout = DocLayout.from_lengths([3, 2])      causal, two documents
    out = varlen_attention(q, k, v, layout)      k: 0 1 2 3 4
                                               q0   x . . . .
                                               q1   x x . . .
                                               q2   x x x . .
                                               q3   . . . x .
                                               q4   . . . x x
"""

from __future__ import annotations

import math
import numbers

import torch

from doccp.kernels import attend, attend_backward, doc_slices, resolve_backend
from doccp.kernels.slices import Slices
from doccp.layout import DocLayout
from doccp.masks import Mask

__all__ = ["varlen_attention"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _VarlenAttention(torch.autograd.Function):
    """out, lse = attend(...); backward = attend_backward with the saved out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, slices: Slices, mask: Mask, scale: float, backend: str):
        out, lse = attend(q, k, v, slices, mask, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.slices, ctx.mask, ctx.scale, ctx.backend = slices, mask, scale, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attend_backward(dout.contiguous(), q, k, v, out, lse, ctx.slices, ctx.mask, ctx.scale,
                                     ctx.backend)
        return dq, dk, dv, None, None, None, None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocLayout,
                     mask: Mask = Mask.causal(), scale: float | None = None, return_lse: bool = False,
                     backend: str = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of every token to the keys of its own document under ``mask``.

    Args:
        q: ``[T, Hq, D]`` queries of the packed stream (THD layout).
        k, v: ``[T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA; K/V are never repeated).
        layout: the documents of the stream; ``layout.num_tokens == T``.
        mask: band on document positions (causal, full, sliding window).
        scale: score scale, default ``1/sqrt(D)``.
        return_lse: also return the log-sum-exp ``[Hq, T]`` (fp32; -inf on rows that see no
            key). It carries no gradient.
        backend: ``auto``, ``reference``, ``cpu`` or ``cuda`` (see :mod:`doccp.kernels`).

    Returns ``out [T, Hq, D]`` in q's dtype (and ``lse``). Differentiable in q, k and v.
    fp32, bf16 and fp16 everywhere; float64 on the ``reference`` (and ``cpu``) backend.
    """
    _check_inputs(q, k, v, layout, mask, scale)
    name = resolve_backend(backend, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, lse = _VarlenAttention.apply(q, k, v, doc_slices(layout.cu_seqlens), mask, scale, name)
    return (out, lse) if return_lse else out


def _check_inputs(q, k, v, layout, mask, scale) -> None:
    """Clear errors naming the argument and the fix, before any kernel sees the tensors."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, H, D] (THD layout), got shape {tuple(x.shape)}; "
                             "flatten a [B, S, H, D] batch with x.flatten(0, 1) and describe it with "
                             "DocLayout.from_packed_rows or DocLayout.from_padded")
        if x.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if not isinstance(layout, DocLayout):
        raise TypeError(f"layout must be a doccp.DocLayout (e.g. DocLayout.from_lengths(lengths)), "
                        f"got {type(layout).__name__}")
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a doccp.Mask (Mask.causal(), Mask.full(), Mask.sliding_window(w)), "
                        f"got {type(mask).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a real number or None (1/sqrt(D)), got {type(scale).__name__}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
                        "cast them with .to(q.dtype)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [T, Hkv, D], got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k/v must hold the same tokens (dimension 0), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must have the same head dim D (dimension 2), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"the number of query heads must be a multiple of the key/value heads (GQA), "
                         f"got Hq={q.shape[1]}, Hkv={k.shape[1]}")
    layout.check_tokens(q, "q")
