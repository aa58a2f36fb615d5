"""The ``cpu`` backend: PyTorch's CPU flash kernel, slices cut into batched kernel calls.

Why this shape. The kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
``_backward``) returns the logsumexp and does GQA natively (no repeated K/V). Its causal
flag skips work only in blocks of 512 keys, and an additive mask costs about what no mask
costs (256- and 512-squares take the same time causal, masked or full; 1024+ squares gain
from causal; docs/benchmarks.md has the kernel measurements). So every slice is trimmed to
the rows and keys that see each other and becomes one kernel *call*, or a few, of three kinds::

    R  rectangle, no mask         causal, late chunk vs prefix   window(2), blocks of 2 rows
    C  top-left causal flag       k:  0 1 2 3 4 5 6 7            k:  0 1 2 3 4 5 6 7
    M  explicit [m, n] band       q4  R R R R C . . .            q0  C . . . . . . .
       mask, shared by the        q5  R R R R C C . .            q1  C C . . . . . .
       whole batch                q6  R R R R C C C .            q2  M M M . . . . .
                                  q7  R R R R C C C C            q3  . M M M . . . .
                                  (one M call while small)       q4  . . M M M . . .
                                                                 q5  . . . M M M . .
    (the two M blocks have one shape: one batched call. A block whose mask would be huge
     is cut into zones instead: keys only the lower edge cuts (M), keys every row sees (R),
     and a top-left triangle (C))

A causal document is one C call, a full one one R call, a windowed one a C call for
its first block, then M blocks. Calls of equal ``(kind, m, n, diagonals)`` run as ONE
batched kernel call, so thousands of short documents cost one call per distinct length,
and all interior blocks of all windowed documents cost one call (batching gathers the rows:
calls with ``SOLO_KEYS`` keys or more, where that copy would cost more than the calls it
saves, run one call each on views). Calls sharing query rows merge by log-sum-exp in fp32.

The backward runs the kernel's backward per call with the *final* merged out and lse:
it computes ``D = rowsum(dO * O)`` and ``P = exp(S - lse)`` from them, which is exactly the
call's share of the gradient, so nothing is recomputed and contributions just add up.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from doccp.kernels.merge import merge_rows
from doccp.kernels.slices import Slices, trim
from doccp.masks import BandMask
from doccp.ranges import expand, repeat

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

RECT, CAUSAL, MASKED = 0, 1, 2  # call kinds: no mask; top-left causal flag; explicit band mask
#: Rows per block of a windowed slice (at most the band width, at least 32); blocks of 64..512
#: rows cost about the same for window 1024 (bench/kernels.py).
BAND_BLOCK = 256
#: A triangle of at least this many keys runs with the causal flag rather than a mask.
CAUSAL_MIN = 1024
#: Larger explicit masks (elements) are avoided by cutting the call into zones instead.
MASK_MAX = 1 << 20
#: Calls with at least this many keys run one each on views instead of in one batched call
#: that gathers (copies) their keys: with one query row per call (decode) the copy costs more
#: than the extra calls from about 8k keys on (bench/inference.py).
SOLO_KEYS = 8192
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# -- cutting slices into kernel calls -------------------------------------------------------
def split_rows(slices: Slices, which: torch.Tensor, height: int) -> Slices:
    """Cut the slices picked by ``which`` into blocks of ``height`` query rows."""
    m = slices.q_end - slices.q_start
    step = torch.where(which, height, m.clamp(min=1))
    blocks = (m + step - 1) // step
    if bool((blocks <= 1).all()):
        return slices
    idx = repeat(torch.arange(len(slices)), blocks)
    offset = expand(torch.zeros_like(step), blocks, step)  # 0, step, 2*step, ... within each slice
    qs = slices.q_start[idx] + offset
    qe = torch.minimum(qs + step[idx], slices.q_end[idx])
    return Slices(qs, qe, slices.k_start[idx], slices.k_end[idx], slices.q_pos0[idx] + offset, slices.k_pos0[idx])


def _diagonals(s: Slices, mask: BandMask) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``i`` of a slice sees keys ``[i + lo, i + hi]`` (relative to the slice)."""
    d = s.q_pos0 - s.k_pos0
    return d - mask.left_bound, d + mask.right_bound


@dataclass(frozen=True)
class Calls:
    """Kernel calls: rows ``[q0, q0+m)`` against keys ``[k0, k0+n)``; a MASKED call's row
    ``i`` sees keys ``[i + lo, i + hi]``."""

    q0: torch.Tensor
    k0: torch.Tensor
    m: torch.Tensor
    n: torch.Tensor
    kind: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor

    @classmethod
    def of(cls, slices: Slices, mask: BandMask) -> Calls:
        """Cut slices into R / C / M calls (module docstring); exact for any band mask."""
        s = trim(slices, mask)
        m = s.q_end - s.q_start
        lo, _ = _diagonals(s, mask)
        lower = m - 1 + lo > 0  # the window's far edge cuts into the slice: needs a mask
        if mask.left is not None:
            height = min(BAND_BLOCK, max(32, mask.left + mask.right_bound + 1))
            s = trim(split_rows(s, lower & (m > height), height), mask)
        m, n = s.q_end - s.q_start, s.k_end - s.k_start
        lo, hi = _diagonals(s, mask)  # trimming made lo <= 0 <= hi
        lo, hi = torch.maximum(lo, 1 - m), torch.minimum(hi, n - 1)  # (canonical, to share calls)
        lower, upper = m - 1 + lo > 0, hi < n - 1  # does the band's lower / upper edge cut in?
        single = torch.where(~lower & ~upper, RECT, torch.where(~lower & (hi == 0), CAUSAL, MASKED))
        # or zones: keys [0, a) only the lower edge cuts, [a, c) all rows see, [c, n) a top-left
        # triangle (valid when no row is taller than the band, as blocking made it where both cut)
        zones = (m * n > MASK_MAX) | (~lower & upper & (n - hi >= CAUSAL_MIN))
        zones &= ~(lower & upper) | (m <= hi - lo + 1)
        a = torch.where(lower, m - 1 + lo, 0).clamp(max=n)
        c = torch.where(upper, hi, n).clamp(min=a)
        zero, q0, k0 = torch.zeros_like(m), s.q_start, s.k_start
        banded = single == MASKED
        parts = [(~zones, q0, k0, m, n, single, torch.where(banded, lo, 0), torch.where(banded, hi, 0)),
                 (zones & (a > 0), q0, k0, m - 1, a, zero + MASKED, lo, torch.minimum(hi, a - 1)),
                 (zones & (c > a), q0, k0 + a, m, c - a, zero + RECT, zero, zero),
                 (zones & (n > c), q0, k0 + c, m, n - c, zero + CAUSAL, zero, zero)]
        return cls(*(torch.cat([p[i][p[0]] for p in parts]) for i in range(1, 8)))

    def __len__(self) -> int:
        return self.q0.numel()

    def coverage(self, side: str, total: int) -> str:
        """How the calls' rows (``side="q"``) or keys (``"k"``) cover ``[0, total)``:
        ``"tiles"`` (each exactly once), ``"disjoint"`` (at most once) or ``"overlaps"``."""
        start, length = (self.q0, self.m) if side == "q" else (self.k0, self.n)
        order = torch.argsort(start)
        start, end = start[order], (start + length)[order]
        if bool((start[1:] < end[:-1]).any()):
            return "overlaps"
        return "tiles" if int(length.sum()) == total else "disjoint"

    def groups(self, dtype: torch.dtype) -> Iterator[tuple[bool, torch.Tensor | None, _Rows, _Rows]]:
        """``(causal flag, mask, rows, keys)`` per distinct call shape: one batched call each
        (one call per call from ``SOLO_KEYS`` keys)."""
        if not len(self):
            return
        fields = torch.stack([self.kind, self.m, self.n, self.lo, self.hi], 1)
        order = torch.arange(len(self))
        for col in reversed(range(fields.shape[1])):  # lexicographic sort (torch.unique(dim=0) is slow)
            order = order[torch.argsort(fields[order, col], stable=True)]
        fields = fields[order]
        first = torch.cat([torch.ones(1, dtype=torch.bool), (fields[1:] != fields[:-1]).any(1)])
        bounds = [*first.nonzero().flatten().tolist(), len(self)]
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            kind, m, n, lo, hi = fields[start].tolist()
            band = _band(m, n, lo, hi, dtype) if kind == MASKED else None
            members = order[start:end]
            for batch in (members,) if n < SOLO_KEYS else members.split(1):
                yield kind == CAUSAL, band, _Rows(self.q0[batch], m), _Rows(self.k0[batch], n)


@functools.lru_cache(maxsize=16)  # at most 16 * MASK_MAX elements
def _band(m: int, n: int, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[m, n]`` mask: row ``i`` sees keys ``[i + lo, i + hi]``. Cached: the same
    few shapes recur every step and in the backward (the kernel never writes to it)."""
    d = torch.arange(n)[None, :] - torch.arange(m)[:, None]
    return torch.zeros(m, n, dtype=dtype).masked_fill_((d < lo) | (d > hi), float("-inf"))


class _Rows:
    """Rows ``start + [0, length)`` of a ``[T, H, D]`` buffer per batch entry, as a
    ``[B, H, length, D]`` kernel operand: a view for a batch of one, else a gather."""

    def __init__(self, start: torch.Tensor, length: int) -> None:
        self.batch, self.length = start.numel(), length
        self.first = int(start[0]) if self.batch == 1 else None
        self.index = None if self.batch == 1 else (start[:, None] + torch.arange(length)).reshape(-1)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return x[self.first : self.first + self.length].transpose(0, 1).unsqueeze(0)
        return x.index_select(0, self.index).unflatten(0, (self.batch, self.length)).transpose(1, 2)

    def take_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """lse ``[H, T]`` -> ``[B, H, length]``."""
        if self.index is None:
            return lse[:, self.first : self.first + self.length].unsqueeze(0)
        return lse.T.index_select(0, self.index).unflatten(0, (self.batch, self.length)).transpose(1, 2)

    def put(self, dst: torch.Tensor, src: torch.Tensor, add: bool = False) -> None:
        """``dst[rows] = src`` (or ``+=``) for ``src [B, H, length, ...]`` and ``dst [T, H, ...]``."""
        src = src.transpose(1, 2).flatten(0, 1)
        if self.index is None:
            rows = dst[self.first : self.first + self.length]
            if add:
                rows.add_(src)
            else:
                rows.copy_(src)
        elif add:
            dst.index_add_(0, self.index, src.to(dst.dtype))
        else:
            dst.index_copy_(0, self.index, src.to(dst.dtype))

    def flat(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row indices [B*length], x as [B*length, H, ...])`` for merging."""
        index = self.index if self.index is not None else torch.arange(
            self.first, self.first + self.length, device=x.device)
        return index, x.transpose(1, 2).flatten(0, 1)


# -- the backend -------------------------------------------------------------------------
def _check(q: torch.Tensor) -> None:
    if q.device.type != "cpu":
        raise ValueError(f"the cpu backend needs CPU tensors, got {q.device}; use backend='auto'")
    if q.dtype not in DTYPES:
        raise TypeError(f"the cpu backend supports {[str(d) for d in DTYPES]}, got {q.dtype}")


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """bf16/fp16 run the kernel in fp32: its low-precision path keeps P and dS in 16 bits
    (several times the gradient error of fp32 math) and, without AMX, its bf16 backward is
    slower than fp32. Inputs are upcast once, results cast back."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _buffer(like: torch.Tensor, shape: tuple[int, ...], coverage: str, fill: float) -> torch.Tensor:
    """An output buffer; left unfilled when the calls will write every row of it."""
    if coverage == "tiles":
        return like.new_empty(shape)
    return like.new_full(shape, fill)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slices: Slices, mask: BandMask, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """out ``[Tq, Hq, D]`` (q's dtype), lse ``[Hq, Tq]`` (fp32); rows in no slice: 0 / -inf."""
    _check(q)
    dtype, compute = q.dtype, _compute_dtype(q)
    q, k, v = (x.to(compute) for x in (q, k, v))
    t, h, _ = q.shape
    calls = Calls.of(slices, mask)
    rows_covered = calls.coverage("q", t)
    out = _buffer(q, (t, h, v.shape[-1]), rows_covered, 0.0)
    lse_t = _buffer(q, (t, h), rows_covered, float("-inf"))  # [Tq, Hq] while filling
    parts = []
    for causal, band, rows, keys in calls.groups(compute):
        o, lse = _FORWARD(rows.take(q), keys.take(k), keys.take(v), 0.0, causal, attn_mask=band, scale=scale)
        if rows_covered == "overlaps":
            parts.append((*rows.flat(o), rows.flat(lse)[1]))
        else:
            rows.put(out, o)
            rows.put(lse_t, lse)
    if parts:
        index, o, lse = (torch.cat(x) for x in zip(*parts, strict=True))
        out, lse_t = merge_rows(index, o, lse, t)
    return out.to(dtype), lse_t.T.contiguous()


def attend_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, slices: Slices, mask: BandMask, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the slices, from the final (merged) out and lse of the query rows."""
    _check(q)
    dtype, compute = q.dtype, _compute_dtype(q)
    dout, q, k, v, out, lse = (x.to(compute) for x in (dout, q, k, v, out, lse))
    calls = Calls.of(slices, mask)
    q_cover, k_cover = calls.coverage("q", q.shape[0]), calls.coverage("k", k.shape[0])
    dq = _buffer(q, q.shape, q_cover, 0.0)
    dk, dv = _buffer(k, k.shape, k_cover, 0.0), _buffer(v, v.shape, k_cover, 0.0)
    for causal, band, rows, keys in calls.groups(compute):
        grads = _BACKWARD(rows.take(dout), rows.take(q), keys.take(k), keys.take(v), rows.take(out),
                          rows.take_lse(lse), 0.0, causal, attn_mask=band, scale=scale)
        for dst, grad, where, cover in zip((dq, dk, dv), grads, (rows, keys, keys), (q_cover, k_cover, k_cover),
                                           strict=True):
            where.put(dst, grad, add=cover == "overlaps")
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)
