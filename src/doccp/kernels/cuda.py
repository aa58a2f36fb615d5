"""The ``cuda`` backend: flash-attention varlen (``torch.nn.attention.varlen``), fp16/bf16.

Run and measured on an H100 with torch 2.11 (``docs/gpu.md``); its tests
(``tests/test_gpu.py``, ``tests/test_kernels.py``) skip without CUDA.

Why no decomposition is needed here: flash varlen takes a batch of sequences and ONE window
``(left, right)`` (``-1`` = unbounded), aligned bottom-right: query ``i`` of an ``m``-row
sequence sees key ``j`` of an ``n``-row sequence iff
``n - m + i - left <= j <= n - m + i + right``. A slice whose first rows sit at document
positions ``qp``/``kp`` sees ``j`` iff ``qp + i - L <= kp + j <= qp + i + R``: the same
band, with ``left = L + (n - m) - (qp - kp)`` and ``right = R - (n - m) + (qp - kp)``. After
:func:`~doccp.kernels.slices.trim` both are ``>= 0`` (the last row sees some key, the last key
is seen by the last row), so every slice is one flash window and slices with equal windows
run as one varlen call (for one device, all documents share ``(L, R)``: a single call).

Device-side entry points :func:`varlen_forward` / :func:`varlen_backward` take device
``cu_seqlens`` and host-known max lengths and never synchronise with the host (for the
``doc_packed_attn`` custom op). Flash marks rows with no key by ``lse = +inf``; here they
are ``-inf`` as everywhere in doccp, and converted back for the backward.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict

import torch

from doccp.device_copies import to_device
from doccp.kernels.merge import merge_rows
from doccp.kernels.slices import Slices, trim
from doccp.masks import BandMask
from doccp.ranges import expand

DTYPES = (torch.float16, torch.bfloat16)
_FLASH_BACKWARD = torch.ops.aten._flash_attention_backward  # what varlen_attn's own backward calls
Window = tuple[int, int]


def available() -> bool:
    """Registered only where CUDA and torch's flash varlen both exist."""
    return torch.cuda.is_available() and _varlen() is not None


@functools.cache
def _varlen():
    """``(varlen_attn, AuxRequest)``, or None before torch 2.10. Imported on first use: the
    module pulls in dynamo (~1.5 s), which CPU-only processes (every spawned rank) skip."""
    try:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn
    except ImportError:  # pragma: no cover - older torch: the backend is simply not registered
        return None
    return varlen_attn, AuxRequest


@functools.cache
def _takes_enable_gqa(varlen_attn) -> bool:
    """torch 2.13's ``varlen_attn`` takes ``enable_gqa``; earlier releases have no such
    argument, and their flash kernel reads Hq != Hkv as grouped heads on its own."""
    import inspect

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _check(q: torch.Tensor) -> None:
    if not q.is_cuda:
        raise ValueError(f"the cuda backend needs CUDA tensors, got {q.device}; use backend='auto'")
    if q.dtype not in DTYPES:
        raise TypeError(f"the cuda backend (flash attention) supports float16 and bfloat16, got {q.dtype}; "
                        "cast q, k, v or use backend='reference'")
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        raise ValueError(f"flash attention needs a head dim that is a multiple of 8 and <= 256, got {q.shape[-1]}")


# -- device-side entry points (no host sync) ------------------------------------------------
def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_q: int, max_k: int, mask: BandMask, scale: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query sequence to its key sequence; ``cu_seqlens_*`` on q's device.

    Sequence ``b``'s queries are the *last* ``m_b`` positions of a document whose keys are
    all ``n_b`` positions (bottom-right; for ``m_b == n_b`` simply the document itself).
    ``max_q``/``max_k`` are host ints bounding the lengths. Returns out ``[Tq, Hq, D]`` and
    lse ``[Hq, Tq]`` (fp32; ``-inf`` on rows that see no key).
    """
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, mask.window_size(), scale)


def varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_q: int,
                    max_k: int, mask: BandMask, scale: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of :func:`varlen_forward`, given its (or a merged, final) out and lse."""
    return _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, mask.window_size(),
                     scale)


def _forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, window: Window, scale):
    varlen_attn, AuxRequest = _varlen()
    gqa = {"enable_gqa": q.shape[1] != k.shape[1]} if _takes_enable_gqa(varlen_attn) else {}
    out, lse = varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                           return_aux=AuxRequest(lse=True), scale=scale, window_size=window, **gqa)
    return out, lse.masked_fill(lse == float("inf"), float("-inf"))


def _backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, window: Window, scale):
    lse = lse.float().masked_fill(lse == float("-inf"), float("inf")).contiguous()  # P = exp(S - inf) = 0
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout is 0: unused
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = _FLASH_BACKWARD(
        dout.contiguous(), q, k, v, out.contiguous(), lse, cu_q.to(torch.int32), cu_k.to(torch.int32),
        max_q, max_k, 0.0, window == (-1, 0), rng_state, unused, scale=scale,
        window_size_left=window[0], window_size_right=window[1])
    return dq, dk, dv


# -- the slice backend -------------------------------------------------------------------------
class _Group:
    """Slices sharing one flash window, packed into one varlen call (gathered unless they
    already tile the buffer in order)."""

    def __init__(self, s: Slices, window: Window, q_rows: int, k_rows: int, device: torch.device) -> None:
        self.window = window
        m, n = s.q_end - s.q_start, s.k_end - s.k_start
        # flash reads a window side >= max_k as unbounded, and turns the unbounded side of a
        # one-sided window into max_k: both are wrong unless max_k exceeds the window and every
        # query sequence's length. max_k is only a bound, so raise it instead.
        self.max_q = int(m.max())
        self.max_k = max(int(n.max()), self.max_q, window[0] + 1, window[1] + 1)
        cu_q, cu_k = (torch.cat([x.new_zeros(1), torch.cumsum(x, 0)]) for x in (m, n))
        q_index, k_index = _ranges(s.q_start, m, q_rows), _ranges(s.k_start, n, k_rows)
        cu_q, cu_k, self.q_index, self.k_index = _to_device([cu_q, cu_k, q_index, k_index], device)
        self.cu_q, self.cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        self.q_rows, self.k_rows = q_rows, k_rows

    def rows(self, device) -> torch.Tensor:
        return self.q_index if self.q_index is not None else torch.arange(self.q_rows, device=device)

    def keys(self, device) -> torch.Tensor:
        return self.k_index if self.k_index is not None else torch.arange(self.k_rows, device=device)


def _ranges(start: torch.Tensor, length: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Concatenated ``[start, start + length)`` ranges; ``None`` when they are just ``0..rows``."""
    index = expand(start, length)
    if index.numel() == rows and torch.equal(index, torch.arange(rows)):
        return None
    return index


def _to_device(host: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """Host int64 tensors on ``device`` through ONE copy that does not stall the host
    (:func:`~doccp.device_copies.to_device`)."""
    present = [x for x in host if x is not None]
    flat = to_device(torch.cat(present), device)
    parts = iter(flat.split([x.numel() for x in present]))
    return [None if x is None else next(parts) for x in host]


def _take(x: torch.Tensor, index: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    return x if index is None else x.index_select(dim, index)


def _groups(slices: Slices, mask: BandMask, q_rows: int, k_rows: int, device) -> list[_Group]:
    """:func:`_grouped`, remembered for the last few distinct arguments: every layer of a model
    attends over the same slices, and the host work would otherwise idle the GPU each time."""
    columns = torch.stack([slices.q_start, slices.q_end, slices.k_start, slices.k_end, slices.q_pos0,
                           slices.k_pos0])
    key = (hashlib.blake2b(columns.numpy().tobytes(), digest_size=16).digest(), mask, q_rows, k_rows,
           str(device))
    groups = _GROUPS.get(key)
    if groups is None:
        groups = _GROUPS[key] = _grouped(slices, mask, q_rows, k_rows, device)
        while len(_GROUPS) > _GROUPS_KEPT:
            _GROUPS.popitem(last=False)
    _GROUPS.move_to_end(key)
    return groups


_GROUPS: OrderedDict = OrderedDict()
_GROUPS_KEPT = 64


def _grouped(slices: Slices, mask: BandMask, q_rows: int, k_rows: int, device) -> list[_Group]:
    """Trimmed slices grouped by their flash window (module docstring)."""
    s = trim(slices, mask)
    if not len(s):
        return []
    m, n, d = s.q_end - s.q_start, s.k_end - s.k_start, s.q_pos0 - s.k_pos0
    left = torch.full_like(m, -1) if mask.left is None else mask.left + (n - m) - d
    right = torch.full_like(m, -1) if mask.right is None else mask.right - (n - m) + d
    # a side that binds no row of any slice is unbounded: keeps a device's documents in one call
    left = torch.where(left >= n.max() - 1, -1, left)
    right = torch.where(right >= m.max() - 1, -1, right)
    # one int64 key per window (both sides are in [-1, 2**31)): a 1-D unique, not a slow row-wise one
    keys, inverse = torch.unique((left + 1) << 32 | (right + 1), return_inverse=True)
    return [_Group(s.select(inverse == g), ((key >> 32) - 1, (key & 0xFFFFFFFF) - 1), q_rows, k_rows, device)
            for g, key in enumerate(keys.tolist())]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slices: Slices, mask: BandMask, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """out ``[Tq, Hq, D]``, lse ``[Hq, Tq]`` fp32; one varlen call per distinct window."""
    _check(q)
    t, h, _ = q.shape
    groups = _groups(slices, mask, t, k.shape[0], q.device)
    parts = []
    for g in groups:
        o, lse = _forward(_take(q, g.q_index), _take(k, g.k_index), _take(v, g.k_index), g.cu_q, g.cu_k,
                          g.max_q, g.max_k, g.window, scale)
        if len(groups) == 1 and g.q_index is None:  # every row exactly once, in order
            return o, lse
        parts.append((g.rows(q.device), o, lse.T))
    if not parts:
        return q.new_zeros(t, h, v.shape[-1]), torch.full((h, t), float("-inf"), device=q.device)
    rows, o, lse = (torch.cat(x) for x in zip(*parts, strict=True))
    out, lse = merge_rows(rows, o, lse, t)
    return out.to(q.dtype), lse.T.contiguous()


def attend_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, slices: Slices, mask: BandMask, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the slices, from the final (merged) out and lse; fp32 accumulation."""
    _check(q)
    groups = _groups(slices, mask, q.shape[0], k.shape[0], q.device)
    grads = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v)]
    for g in groups:
        qi, ki = g.q_index, g.k_index
        part = _backward(_take(dout, qi), _take(q, qi), _take(k, ki), _take(v, ki), _take(out, qi),
                         _take(lse, qi, dim=1), g.cu_q, g.cu_k, g.max_q, g.max_k, g.window, scale)
        if len(groups) == 1 and qi is None and ki is None:
            return part
        for acc, grad, index in zip(grads, part, (g.rows(q.device), g.keys(q.device), g.keys(q.device)),
                                    strict=True):
            acc.index_add_(0, index, grad.float())
    return tuple(acc.to(x.dtype) for acc, x in zip(grads, (q, k, v), strict=True))
