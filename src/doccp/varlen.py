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

import torch

from doccp.checks import layout_problem, mask_problem, qkv_problem, raise_if, scale_problem
from doccp.kernels import attend, attend_backward, default_scale, doc_slices, resolve_backend
from doccp.kernels.slices import Slices
from doccp.layout import DocLayout
from doccp.masks import Mask

__all__ = ["varlen_attention"]

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
    scale = default_scale(q, scale)
    out, lse = _VarlenAttention.apply(q, k, v, doc_slices(layout.cu_seqlens), mask, scale, name)
    return (out, lse) if return_lse else out


def _check_inputs(q, k, v, layout, mask, scale) -> None:
    """Clear errors naming the argument and the fix, before any kernel sees the tensors."""
    raise_if(qkv_problem(q, k, v) or layout_problem(layout) or mask_problem(mask) or scale_problem(scale))
    layout.check_tokens(q, "q")
