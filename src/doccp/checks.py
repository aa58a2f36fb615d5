"""Input checks shared by every entry point: one rule per property, one message per problem.

Each check *returns* the problem (an exception, not raised) or ``None``. A collective entry
point (``attention``, ``prefill``, ``decode``, ``unshard``, the padded API) hands it to
:func:`doccp.agreement.agree`, so that every rank raises the same error instead of the healthy
ranks waiting for the broken one; a local entry point (``varlen_attention``,
``doc_packed_attn``) raises it at once. The checks read metadata only (types, shapes, dtypes,
devices): they never synchronise with a device and they trace under ``torch.compile``.

The rules, for q/k/v in THD ``[T, H, D]`` or BSHD ``[B, S, H, D]`` form:

- q, k, v are tensors of one floating dtype (fp32, bf16, fp16, fp64) on one device;
- k and v have the same shape; q holds the same tokens (every dimension before the heads);
- the head dim is at least 1 and q's equals k's; ``Hkv >= 1`` and ``Hq % Hkv == 0`` (GQA);
- ``scale`` is ``None`` (``1/sqrt(D)``) or a finite real number.

Any stride is accepted (the kernels copy a tensor only when its last dimension is not dense).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask

#: Floating dtypes every backend accepts (fp64 runs on the reference and cpu backends).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

#: Tensor forms: name -> (dimensions, what they are).
FORMS = {"THD": (3, "[T, heads, head_dim]"), "BSHD": (4, "[B, S, heads, head_dim]")}


def qkv_problem(q: object, k: object, v: object, form: str = "THD") -> Exception | None:
    """What is wrong with ``q, k, v`` as attention inputs of ``form`` (THD or BSHD), or None."""
    ndim, spelled = FORMS[form]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != ndim:
            hint = (" (flatten a [B, S, H, D] batch with x.flatten(0, 1) and describe it with "
                    "DocLayout.from_packed_rows or DocLayout.from_padded)" if form == "THD" and x.dim() == 4 else "")
            return ValueError(f"{name} must be {ndim}-D {spelled}, got shape {tuple(x.shape)}{hint}")
        if x.dtype not in FLOAT_DTYPES:
            return TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not q.dtype == k.dtype == v.dtype:
        return TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
                         "cast them with .to(q.dtype)")
    if not q.device == k.device == v.device:
        return ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if k.shape != v.shape:
        return ValueError(f"k and v must have the same shape, got {shapes}")
    if q.shape[:-2] != k.shape[:-2]:
        return ValueError(f"q and k/v must hold the same tokens (every dimension before the heads), got {shapes}")
    if q.shape[-1] < 1 or q.shape[-1] != k.shape[-1]:
        return ValueError(f"q and k must have the same head_dim, at least 1, got {shapes}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or hq % hkv:
        return ValueError(f"the number of query heads ({hq}) must be a multiple of the number of KV heads ({hkv}) "
                          "for grouped-query attention, and KV heads at least 1")
    return None


def scale_problem(scale: object) -> Exception | None:
    """``scale`` must be None (``1/sqrt(head_dim)``) or a finite real number."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        return TypeError(f"scale must be a real number or None (for 1/sqrt(head_dim)), got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        return ValueError(f"scale must be finite, got {scale}")
    return None


def choice_problem(value: object, name: str, options: Iterable[str]) -> Exception | None:
    """``value`` must be one of ``options`` (listed in the message)."""
    options = list(options)
    if isinstance(value, str) and value in options:
        return None
    return ValueError(f"{name} must be one of {options}, got {value!r}")


def mask_problem(mask: object) -> Exception | None:
    if isinstance(mask, Mask):
        return None
    return TypeError(f"mask must be a doccp.Mask (Mask.causal(), Mask.full(), Mask.sliding_window(w)), "
                     f"got {type(mask).__name__}")


def layout_problem(layout: object) -> Exception | None:
    if isinstance(layout, DocLayout):
        return None
    return TypeError(f"layout must be a doccp.DocLayout (e.g. DocLayout.from_lengths(lengths)), "
                     f"got {type(layout).__name__}")


def first(*problems: Exception | None) -> Exception | None:
    """The first problem of several independent checks (each evaluated already)."""
    return next((p for p in problems if p is not None), None)


def raise_if(problem: Exception | None) -> None:
    if problem is not None:
        raise problem
