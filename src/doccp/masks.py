"""Attention masks on document-relative positions: one protocol, bands and chunks implementing it.

A mask says which key position ``j`` a query at position ``i`` of the *same* document sees.
Because it is defined on positions, any chunk of a document is masked exactly by knowing where
the chunk starts; nothing downstream needs the whole document. What the rest of doccp needs
from a mask is the whole :class:`Mask` protocol:

- ``visible_keys(q_start, q_end, doc_len)`` / ``visible_queries(k_start, k_end, doc_len)``: the
  hull of the keys a query range sees (of the queries a key range is seen by): the exchange,
  the ring blocks and the slices are cut with them;
- ``pairs(q_start, q_end, k_start, k_end)``: the exact number of visible pairs of two ranges (the
  work the planner balances), in closed form;
- ``allows(i, j)``: the definition itself, elementwise (the float64 oracle and tests);
- ``bands(slices)``: the slices rewritten as slices under :class:`BandMask` es, the one kind the
  kernels know; a band mask is its own single band.

Every mask here is a *monotone interval* mask: a query sees one interval of keys, and both ends
of that interval never decrease as the query moves right. So the hull of a range's visible keys
is reached at its first and last query, and "keys every query of a range sees" is an interval too.

``causal`` is the band ``(inf, 0)``, ``full`` ``(inf, inf)``, ``sliding_window(w)`` ``(w, 0)``;
``chunked(s)`` (Llama 4's local attention) lets a query see the keys of its own ``s``-token chunk
of the document, causally::

    causal        full          sliding_window(2)   chunked(2)
    x . . . .     x x x x x     x . . . .           x . . . .
    x x . . .     x x x x x     x x . . .           x x . . .
    x x x . .     x x x x x     x x x . .           . . x . .
    x x x x .     x x x x x     . x x x .           . . x x .
    x x x x x     x x x x x     . . x x x           . . . . x
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

#: Stand-in for an unbounded side of the band: farther than any position of any layout
#: (``DocLayout`` holds at most ``MAX_TOKENS = 2**31 - 1`` tokens) yet small enough that the
#: closed-form pair counts stay exact in int64. A window at least this wide is unbounded.
UNBOUNDED = 1 << 32
#: Largest window side a Mask accepts (int64); wider ones cannot be represented.
INT64_MAX = (1 << 63) - 1

Ints = torch.Tensor | int


class Mask(ABC):
    """The mask protocol (module docstring), and the constructors of every mask.

    ``Mask(left, right)`` builds a :class:`BandMask` (query ``i`` sees keys ``i - left .. i + right``
    of its document; ``None`` = unbounded), as it always has.
    """

    #: Names this kind of mask in custom-op specs (:meth:`spec`).
    KIND: ClassVar[int]

    def __new__(cls, *args, **kwargs):
        return super().__new__(BandMask if cls is Mask else cls)

    # -- constructors ----------------------------------------------------------------
    @staticmethod
    def causal() -> BandMask:
        return BandMask(None, 0)

    @staticmethod
    def full() -> BandMask:
        return BandMask(None, None)

    @staticmethod
    def sliding_window(left: int, right: int = 0) -> BandMask:
        """Query ``i`` sees keys ``i-left .. i+right`` of its own document."""
        return BandMask(left, right)

    @staticmethod
    def chunked(size: int) -> Mask:
        """Query ``i`` sees keys ``j <= i`` of its own ``size``-token chunk of the document (a chunk
        at least as long as any document is :meth:`causal`)."""
        return ChunkedMask(size) if _check_side("ChunkedMask.size", size, minimum=1) < UNBOUNDED else Mask.causal()

    @staticmethod
    def parse(text: str) -> Mask:
        """Parse ``causal``, ``full``, ``window:L[,R]`` or ``chunked:S`` (the CLI spelling)."""
        text = text.strip().lower()
        if text == "causal":
            return Mask.causal()
        if text == "full":
            return Mask.full()
        for prefix, arity in (("window:", (1, 2)), ("chunked:", (1,))):
            if text.startswith(prefix):
                try:
                    values = [int(p) for p in text[len(prefix):].split(",")]
                except ValueError:
                    values = []
                if len(values) in arity:
                    return Mask.sliding_window(*values) if prefix == "window:" else Mask.chunked(*values)
        raise ValueError(f"mask must be 'causal', 'full', 'window:LEFT[,RIGHT]' or 'chunked:SIZE', got {text!r}")

    @staticmethod
    def from_spec(spec: list[int] | tuple[int, ...]) -> Mask:
        """The mask of :meth:`spec` (how custom ops carry a mask: a list of ints)."""
        kind, *args = spec
        if kind == BandMask.KIND:
            left, right = args
            return BandMask(None if left < 0 else left, None if right < 0 else right)
        if kind == ChunkedMask.KIND:
            return ChunkedMask(args[0])
        raise ValueError(f"unknown mask spec {list(spec)}")

    # -- the protocol --------------------------------------------------------------------
    looks_ahead: bool  # whether any query sees a later key (inference needs False)

    @abstractmethod
    def spec(self) -> list[int]:
        """The mask as a list of ints, ``[KIND, ...]`` (see :meth:`from_spec`)."""

    @abstractmethod
    def allows(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Whether query position ``i`` sees key position ``j`` (elementwise, broadcasting)."""

    @abstractmethod
    def visible_keys(self, q_start: Ints, q_end: Ints, doc_len: Ints) -> tuple[Ints, Ints]:
        """Key range ``[lo, hi)`` seen by any query in ``[q_start, q_end)`` of a document of
        ``doc_len`` tokens (elementwise on ints or int64 tensors; empty: ``hi <= lo``). Like every
        range function here, the results may be the arguments themselves: read them, never write."""

    @abstractmethod
    def visible_queries(self, k_start: Ints, k_end: Ints, doc_len: Ints) -> tuple[Ints, Ints]:
        """Query range ``[lo, hi)`` of the queries that see some key in ``[k_start, k_end)``."""

    @abstractmethod
    def pairs(self, q_start: Ints, q_end: Ints, k_start: Ints, k_end: Ints) -> torch.Tensor:
        """Exact number of visible (query, key) pairs between two ranges of one document, in
        closed form (O(1) per range pair, elementwise over int64 tensors or ints)."""

    def row_work(self, q_start: Ints, q_end: Ints, doc_len: Ints) -> torch.Tensor:
        """Pairs of the query rows ``[q_start, q_end)`` (within their document) with every key of
        their document of ``doc_len`` tokens: the work a rank does for them, what the planners
        balance. ``pairs(q_start, q_end, 0, doc_len)``, in fewer steps where the mask allows (the
        planners evaluate it for every candidate cut)."""
        return self.pairs(q_start, q_end, 0, doc_len)

    @abstractmethod
    def bands(self, slices):
        """``[(slices, band), ...]``: the same pairs as ``slices`` under this mask, as slices under
        band masks (what the kernels compute); parts never share a (query, key) pair."""

    def row_costs(self, doc_len: int) -> torch.Tensor:
        """Visible keys of every query row of a document of ``doc_len`` tokens (int64)."""
        i = torch.arange(doc_len, dtype=torch.int64)
        lo, hi = self.visible_keys(i, i + 1, doc_len)
        return (torch.as_tensor(hi) - torch.as_tensor(lo)).clamp(min=0)


@dataclass(frozen=True)
class BandMask(Mask):
    """A band around the diagonal: query ``i`` sees key ``j`` iff ``i - left <= j <= i + right``
    (``None`` on a side means unbounded). A side of ``UNBOUNDED`` (2**32) or more reaches past
    every document and is stored as ``None``: ``Mask.sliding_window(10**12) == Mask.causal()``."""

    KIND: ClassVar[int] = 0
    left: int | None = None
    right: int | None = 0

    def __post_init__(self) -> None:
        for name in ("left", "right"):
            value = getattr(self, name)
            if value is not None and _check_side(f"Mask.{name}", value, minimum=0) >= UNBOUNDED:
                object.__setattr__(self, name, None)

    @property
    def left_bound(self) -> int:
        return UNBOUNDED if self.left is None else self.left

    @property
    def right_bound(self) -> int:
        return UNBOUNDED if self.right is None else self.right

    @property
    def is_causal(self) -> bool:
        return self.left is None and self.right == 0

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None

    @property
    def looks_ahead(self) -> bool:
        return self.right != 0

    def window_size(self) -> tuple[int, int]:
        """flash-attention's ``(left, right)`` convention: ``-1`` for unbounded."""
        return (-1 if self.left is None else self.left, -1 if self.right is None else self.right)

    def spec(self) -> list[int]:
        return [self.KIND, *self.window_size()]

    def __str__(self) -> str:
        if self.is_causal:
            return "causal"
        if self.is_full:
            return "full"
        right = "inf" if self.right is None else self.right
        left = "inf" if self.left is None else self.left
        return f"window({left},{right})"

    def allows(self, i, j):
        d = j - i
        return (d >= -self.left_bound) & (d <= self.right_bound)

    def visible_keys(self, q_start, q_end, doc_len):
        return _reach_down(q_start, self.left), _reach_up(q_end, self.right, doc_len)

    def visible_queries(self, k_start, k_end, doc_len):
        return _reach_down(k_start, self.right), _reach_up(k_end, self.left, doc_len)

    def pairs(self, q_start, q_end, k_start, k_end):
        """``#{(i, j): q_start <= i < q_end, k_start <= j < k_end, -left <= j - i <= right}``."""
        qs, qe, ks, ke = (torch.as_tensor(x, dtype=torch.int64) for x in (q_start, q_end, k_start, k_end))
        nq = (qe - qs).clamp(min=0)
        nk = (ke - ks).clamp(min=0)
        upper = _pairs_below(nq, nk, self.right_bound - (ks - qs))
        if self.left is None:  # no pair lies UNBOUNDED below the diagonal (ranges of one layout)
            return upper
        lower = _pairs_below(nq, nk, -self.left_bound - 1 - (ks - qs))
        return upper - lower

    def row_work(self, q_start, q_end, doc_len):
        if not (self.is_causal or self.is_full):
            return super().row_work(q_start, q_end, doc_len)
        qs, qe = (torch.as_tensor(x, dtype=torch.int64) for x in (q_start, q_end))
        qe = torch.maximum(qe, qs)
        if self.is_full:
            return (qe - qs) * torch.as_tensor(doc_len, dtype=torch.int64)
        return (qe * (qe + 1) - qs * (qs + 1)) >> 1  # causal: row i sees its i + 1 first keys

    def bands(self, slices):
        return [(slices, self)]


@dataclass(frozen=True)
class ChunkedMask(Mask):
    """Chunked local attention: the document is cut into ``size``-token chunks from its start,
    and query ``i`` sees keys ``j <= i`` of its own chunk."""

    KIND: ClassVar[int] = 1
    size: int
    looks_ahead: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_side("ChunkedMask.size", self.size, minimum=1)

    def __str__(self) -> str:
        return f"chunked({self.size})"

    def spec(self) -> list[int]:
        return [self.KIND, self.size]

    def _start(self, pos):
        return pos // self.size * self.size

    def allows(self, i, j):
        return (j <= i) & (i // self.size == j // self.size)

    def visible_keys(self, q_start, q_end, doc_len):
        return self._start(q_start), _minimum(q_end, doc_len)

    def visible_queries(self, k_start, k_end, doc_len):
        chunk_end = self._start(k_end - 1) + self.size
        return k_start, _minimum(_maximum(chunk_end, k_end), doc_len)

    def pairs(self, q_start, q_end, k_start, k_end):
        qs, qe, ks, ke = (torch.as_tensor(x, dtype=torch.int64) for x in (q_start, q_end, k_start, k_end))
        qe, ke = torch.maximum(qe, qs), torch.maximum(ke, ks)
        return self._below(qe, ke) - self._below(qs, ke) - self._below(qe, ks) + self._below(qs, ks)

    def _below(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``#{(i, j): i < x, j < y, j <= i, same chunk}``: whole chunks below ``min(x, y)`` hold a
        triangle each; only the chunk where the smaller of the two ends is cut differs."""
        s = self.size
        whole = torch.minimum(x, y) // s
        corner = whole * s
        return whole * (s * (s + 1) // 2) + _CAUSAL.pairs(corner, torch.minimum(x, corner + s),
                                                          corner, torch.minimum(y, corner + s))

    def bands(self, slices):
        """Each slice cut at the chunk boundaries of its queries, keys limited to that chunk:
        causal bands, one per (slice, chunk) the slice's queries touch."""
        from doccp.kernels.slices import Slices  # (the mask layer sits below the slices)
        from doccp.ranges import expand, repeat

        s = self.size
        m = (slices.q_end - slices.q_start).clamp(min=0)
        first = slices.q_pos0 // s
        chunks = torch.where(m > 0, (slices.q_pos0 + m - 1) // s - first + 1, 0)
        which = repeat(torch.arange(len(slices)), chunks)
        c0 = expand(first, chunks) * s
        q_lo = torch.maximum(slices.q_pos0[which], c0)
        q_hi = torch.minimum(slices.q_pos0[which] + m[which], c0 + s)
        k_pos, k_len = slices.k_pos0[which], (slices.k_end - slices.k_start)[which]
        k_lo = torch.maximum(k_pos, c0)
        k_hi = torch.minimum(k_pos + k_len, torch.minimum(c0 + s, q_hi))  # causal: no key past the last query
        keep = k_hi > k_lo
        q_start = slices.q_start[which] + (q_lo - slices.q_pos0[which])
        k_start = slices.k_start[which] + (k_lo - k_pos)
        parts = Slices(q_start, q_start + (q_hi - q_lo), k_start, k_start + (k_hi - k_lo), q_lo, k_lo).select(keep)
        return [(parts, _CAUSAL)]



def _check_side(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < minimum:
        hint = " (a window cannot exclude the diagonal)" if minimum == 0 else ""
        raise ValueError(f"{name} must be >= {minimum}{hint}, got {value}")
    if value > INT64_MAX:
        raise ValueError(f"{name}={value} cannot be represented (the limit is 2**63 - 1); use None for an "
                         "unbounded side")
    return value


def _pairs_below(nq: torch.Tensor, nk: torch.Tensor, t: torch.Tensor | int) -> torch.Tensor:
    """``#{(x, y) in [0,nq) x [0,nk): y - x <= t}`` = sum_x clamp(x + t + 1, 0, nk)."""
    a = torch.as_tensor(t, dtype=torch.int64) + 1
    return _ramp_sum(a + nq, nk) - _ramp_sum(a, nk)


def _ramp_sum(z: torch.Tensor, nk: torch.Tensor) -> torch.Tensor:
    """``sum_{u=0}^{z-1} clamp(u, 0, nk)`` (0 for z <= 0), in closed form."""
    z = torch.clamp(torch.as_tensor(z, dtype=torch.int64), min=0)
    zc = torch.minimum(z, nk + 1)
    return zc * (zc - 1) // 2 + (z - zc) * nk


def _reach_down(x, side: int | None):
    """``max(x - side, 0)``; an unbounded side reaches 0 (no arithmetic on host tables: causal
    and full masks are the hot path of every schedule)."""
    if side is None:
        return torch.zeros_like(x) if isinstance(x, torch.Tensor) else 0
    return _maximum(x - side if side else x, 0)


def _reach_up(x, side: int | None, limit):
    """``min(x + side, limit)``; an unbounded side reaches ``limit`` (shaped like the two)."""
    if side is not None:
        return _minimum(x + side if side else x, limit)
    if not isinstance(x, torch.Tensor) and not isinstance(limit, torch.Tensor):
        return limit
    x, limit = torch.as_tensor(x), torch.as_tensor(limit)
    return limit if x.shape == limit.shape else torch.broadcast_to(limit, torch.broadcast_shapes(x.shape, limit.shape)
                                                                   ).contiguous()


def _maximum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def _minimum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return min(a, b)


_CAUSAL = BandMask(None, 0)
