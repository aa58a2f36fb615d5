"""``doc_packed_attn``: attention over ``[B, S, H, D]`` rows of packed documents, as a custom op.

Each batch row packs documents back to back; ``cu_rows[b]`` holds row ``b``'s boundaries padded
with the sentinel ``S`` (zero-length trailing documents), so every row has the same shape
whatever its document count::

    S = 6, causal        row 0: docs of 2 and 4       row 1: one doc of 6
    cu_rows = [[0, 2, 6],       k: 0 1 2 3 4 5           k: 0 1 2 3 4 5
               [0, 6, 6]]    q0    x . . . . .         q0    x . . . . .
                             q1    x x . . . .         q1    x x . . . .
                             q2    . . x . . .         q2    x x x . . .
                             q3    . . x x . .         q3    x x x x . .
                             q4    . . x x x .         q4    x x x x x .
                             q5    . . x x x x         q5    x x x x x x

That fixed shape is what makes the op shardable without ragged shapes: batch is a clean
``Shard(0)`` (data parallel) and heads a clean ``Shard(2)`` (tensor parallel); the DTensor rules
live in :mod:`doccp.interop.doc_packed_sharding`.

The op is registered with ``torch.library`` as ``doccp::doc_packed_attn`` and
``doccp::doc_packed_attn_backward`` with fake kernels, so ``opcheck`` passes and
``torch.compile(fullgraph=True)`` traces it. The mask travels as a list of ints (:meth:`Mask.spec`).
The backward takes the forward's saved ``out`` and ``lse``: it never recomputes the forward.

Kernels see one packed stream ``[B*S, H, D]``. On CUDA the device varlen kernel gets
``cu_seqlens`` built on the device with ``max_len = S``, so the host never syncs on ``cu_rows``
(and cannot validate its values). Elsewhere ``cu_rows`` is read and validated on the host and
becomes one slice per document for :func:`doccp.kernels.attend`.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from doccp import kernels
from doccp.checks import mask_problem, qkv_problem, raise_if, scale_problem
from doccp.layout import DocLayout
from doccp.masks import BandMask, Mask

__all__ = ["doc_packed_attn"]


def doc_packed_attn(q: Tensor, k: Tensor, v: Tensor, cu_rows: Tensor, mask: Mask = Mask.causal(),
                    scale: float | None = None, *, return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention within the documents of each row; GQA when ``Hq`` is a multiple of ``Hkv``.

    q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]``, ``cu_rows [B, MAX_DOCS+1]`` int32/int64 on q's
    device (each row ``0 = c_0 <= c_1 <= ... <= c_M = S``). ``scale`` defaults to ``D**-0.5``.
    Returns out ``[B, S, Hq, Dv]`` in q's dtype and, with ``return_lse``, also the differentiable
    log-sum-exp ``[B, Hq, S]`` in fp32 (fp64 for fp64 inputs), e.g. to merge with other partials.
    """
    _check_inputs(q, k, v, cu_rows, mask, scale)
    out, lse = doc_packed_attn_op(q, k, v, cu_rows, mask.spec(), None if scale is None else float(scale))
    return (out, lse) if return_lse else out


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, cu_rows: Tensor, mask: Mask, scale: float | None) -> None:
    """Shape, dtype and device checks (the rules of :mod:`doccp.checks`): metadata only, so they
    trace and never sync."""
    raise_if(qkv_problem(q, k, v, "BSHD") or mask_problem(mask) or scale_problem(scale))
    if not isinstance(cu_rows, Tensor):
        raise TypeError(f"cu_rows must be a torch.Tensor, got {type(cu_rows).__name__}")
    if cu_rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_rows must be an int32 or int64 tensor, got {cu_rows.dtype}")
    b = q.shape[0]
    if cu_rows.dim() != 2 or cu_rows.shape[0] != b or cu_rows.shape[1] < 2:
        raise ValueError(f"cu_rows must be [B={b}, MAX_DOCS+1 >= 2], got {tuple(cu_rows.shape)}")
    if cu_rows.device != q.device:
        raise ValueError(f"cu_rows must be on q's device {q.device}, got {cu_rows.device}")


# -- kernels on the flattened stream ------------------------------------------------------
def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _device_kernels(q: Tensor, mask: Mask) -> ModuleType | None:
    """The CUDA backend's device-side varlen entry points, if present and the mask is a band
    (one flash window per call); else the host path."""
    if not q.is_cuda or q.dtype == torch.float64 or not isinstance(mask, BandMask):
        return None
    try:
        from doccp.kernels import cuda
    except ImportError:
        return None
    return cuda if hasattr(cuda, "varlen_forward") and hasattr(cuda, "varlen_backward") else None


def _device_cu_seqlens(cu_rows: Tensor, seq_len: int) -> Tensor:
    """Row boundaries -> boundaries in the flattened ``[B*S]`` stream, on the device (no sync)."""
    b = cu_rows.shape[0]
    offsets = torch.arange(b, device=cu_rows.device, dtype=torch.int32)[:, None] * seq_len
    starts = (cu_rows[:, :-1].to(torch.int32) + offsets).reshape(-1)
    return torch.cat([starts, starts.new_full((1,), b * seq_len)])


def _host_slices(cu_rows: Tensor, seq_len: int) -> kernels.Slices:
    """Validate ``cu_rows`` on the host (clear ValueErrors) and emit one slice per document."""
    return kernels.doc_slices(DocLayout.from_packed_rows(cu_rows, seq_len).cu_seqlens)


def _flat(*tensors: Tensor) -> list[Tensor]:
    return [t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in tensors]


def _forward_flat(q: Tensor, k: Tensor, v: Tensor, cu_rows: Tensor, mask: Mask, scale: float
                  ) -> tuple[Tensor, Tensor]:
    """``[B, S, H, D]`` inputs -> out ``[B*S, Hq, Dv]``, lse ``[Hq, B*S]``."""
    s = q.shape[1]
    qf, kf, vf = _flat(q, k, v)
    device = _device_kernels(q, mask)
    if device is not None:
        cu = _device_cu_seqlens(cu_rows, s)
        return device.varlen_forward(qf, kf, vf, cu, cu, s, s, mask, scale)
    return kernels.attend(qf, kf, vf, _host_slices(cu_rows, s), mask, scale)


def _backward_flat(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_rows: Tensor,
                   mask: Mask, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Flat dq, dk, dv given flat ``dout``/``out`` ``[B*S, Hq, Dv]`` and ``lse [Hq, B*S]``."""
    s = q.shape[1]
    qf, kf, vf = _flat(q, k, v)
    device = _device_kernels(q, mask)
    if device is not None:
        cu = _device_cu_seqlens(cu_rows, s)
        return device.varlen_backward(dout, qf, kf, vf, out, lse, cu, cu, s, s, mask, scale)
    return kernels.attend_backward(dout, qf, kf, vf, out, lse, _host_slices(cu_rows, s), mask, scale)


def _lse_grad_stand_ins(dlse: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
    """``(dout', out')`` that make any attention backward return the gradient through lse.

    A backward computes ``dS = P * (dout·v - rowsum(dout * out))``; the gradient through lse is
    ``dS = P * dlse``. With ``v' = 0``, ``dout' = e_0`` and ``out' = -dlse * e_0`` the kernel's
    ``dq, dk`` are exactly that (its ``dv`` is discarded), on every backend, with no forward.
    """
    e0 = torch.zeros_like(out)
    e0[..., 0] = 1
    return e0, -dlse.to(out.dtype)[..., None] * e0


# -- the custom ops -----------------------------------------------------------------------
@torch.library.custom_op("doccp::doc_packed_attn", mutates_args=())
def doc_packed_attn_op(q: Tensor, k: Tensor, v: Tensor, cu_rows: Tensor, mask: list[int],
                       scale: float | None) -> tuple[Tensor, Tensor]:
    """out ``[B, S, Hq, Dv]``, lse ``[B, Hq, S]``; ``mask`` is :meth:`doccp.Mask.spec`."""
    b, s, hq = q.shape[:3]
    out, lse = _forward_flat(q, k, v, cu_rows, Mask.from_spec(mask), kernels.default_scale(q, scale))
    return out.reshape(b, s, hq, v.shape[-1]).contiguous(), lse.reshape(hq, b, s).transpose(0, 1).contiguous()


@doc_packed_attn_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_rows: Tensor, mask: list[int], scale: float | None
      ) -> tuple[Tensor, Tensor]:
    b, s, hq = q.shape[:3]
    return q.new_empty(b, s, hq, v.shape[-1]), q.new_empty(b, hq, s, dtype=_lse_dtype(q))


@torch.library.custom_op("doccp::doc_packed_attn_backward", mutates_args=())
def doc_packed_attn_backward_op(dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                lse: Tensor, cu_rows: Tensor, mask: list[int], scale: float | None
                                ) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv from the saved ``out``/``lse``; ``dlse`` (optional) is the gradient through lse."""
    b, s, hq = q.shape[:3]
    mask_, scale_ = Mask.from_spec(mask), kernels.default_scale(q, scale)
    out_f, dout_f = _flat(out, dout)
    lse_f = lse.transpose(0, 1).reshape(hq, b * s)
    dq, dk, dv = _backward_flat(dout_f, q, k, v, out_f, lse_f, cu_rows, mask_, scale_)
    if dlse is not None:
        e0, out_stand_in = _lse_grad_stand_ins(dlse.transpose(1, 2).reshape(b * s, hq), out_f)
        dq_l, dk_l, _ = _backward_flat(e0, q, k, torch.zeros_like(v), out_stand_in, lse_f, cu_rows, mask_, scale_)
        dq, dk = dq + dq_l, dk + dk_l
    return tuple(g.reshape(t.shape).contiguous() for g, t in ((dq, q), (dk, k), (dv, v)))


@doc_packed_attn_backward_op.register_fake
def _(dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
      cu_rows: Tensor, mask: list[int], scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_rows, mask, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_rows, out, lse)
    ctx.mask_scale = (mask, scale)
    ctx.set_materialize_grads(False)  # an unused lse (or out) sends None: no extra kernel call


def _backward(ctx, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, cu_rows, out, lse = ctx.saved_tensors
    if dout is None and dlse is None:
        return (None,) * 6
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = doc_packed_attn_backward_op(dout, dlse, q, k, v, out, lse, cu_rows, *ctx.mask_scale)
    return dq, dk, dv, None, None, None


doc_packed_attn_op.register_autograd(_backward, setup_context=_setup_context)

if torch.distributed.is_available():
    from doccp.interop.doc_packed_sharding import register_rules

    register_rules(torch.ops.doccp.doc_packed_attn.default, torch.ops.doccp.doc_packed_attn_backward.default)
