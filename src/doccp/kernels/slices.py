"""Slices: the work list a CP algorithm hands to a kernel.

A slice says: query rows ``[q_start, q_end)`` of a q buffer attend to key rows
``[k_start, k_end)`` of a k/v buffer, and the first of those rows sit at document
positions ``q_pos0`` and ``k_pos0``. With the mask defined on document positions that is
enough to mask any chunk of a document exactly; the kernel never needs to know about ranks::

    doc of 8 tokens, causal; rank holds q = positions 4..7, k buffer = positions 0..7
    slice(q 0:4 @ pos 4, k 0:8 @ pos 0)      k: 0 1 2 3 4 5 6 7
                                           q4   x x x x x . . .
                                           q5   x x x x x x . .
                                           q6   x x x x x x x .
                                           q7   x x x x x x x x

Several slices may target the same query rows (their partial results merge by LSE);
query rows in no slice get ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from doccp.masks import BandMask, Mask
from doccp.ranges import all_true, expand, index_of, repeat, take

FIELDS = ("q_start", "q_end", "k_start", "k_end", "q_pos0", "k_pos0")


@dataclass(frozen=True)
class Slices:
    """Column-wise int64 CPU tensors, one entry per slice (see module docstring)."""

    q_start: torch.Tensor
    q_end: torch.Tensor
    k_start: torch.Tensor
    k_end: torch.Tensor
    q_pos0: torch.Tensor
    k_pos0: torch.Tensor

    @classmethod
    def of(cls, *columns) -> Slices:
        cols = [torch.as_tensor(c, dtype=torch.int64).reshape(-1) for c in columns]
        return cls(*cols)

    @classmethod
    def empty(cls) -> Slices:
        return cls.of(*([[]] * 6))

    @classmethod
    def cat(cls, parts: list[Slices]) -> Slices:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in FIELDS)) if parts else cls.empty()

    def __len__(self) -> int:
        return self.q_start.numel()

    def select(self, keep) -> Slices:
        index = index_of(keep)
        return self if index is None else Slices(*(take(getattr(self, f), index) for f in FIELDS))

    def rows(self) -> list[tuple[int, int, int, int, int, int]]:
        return list(zip(*(getattr(self, f).tolist() for f in FIELDS), strict=True))


def doc_slices(cu_seqlens: torch.Tensor) -> Slices:
    """One slice per non-empty document of a packed stream: the single-device case."""
    start, end = cu_seqlens[:-1], cu_seqlens[1:]
    keep = end > start
    index = index_of(keep)
    start, end = take(start, index), take(end, index)
    zero = torch.zeros_like(start)
    return Slices(start, end, start, end, zero, zero)


def pair_slices(q_doc: torch.Tensor, q_row: torch.Tensor, q_pos: torch.Tensor, q_len: torch.Tensor,
                k_doc: torch.Tensor, k_row: torch.Tensor, k_pos: torch.Tensor, k_len: torch.Tensor,
                mask: Mask) -> Slices:
    """Slices for every (query segment, key segment) pair of the same document that share at
    least one visible pair, trimmed to the rows and keys that can see each other.

    A segment is ``(doc, first buffer row, first document position, length)``. The pairs are
    found by a join on the document (binary searches into the key segments sorted by doc);
    :func:`paired` trims them.
    """
    if q_doc.numel() == 0 or k_doc.numel() == 0:
        return Slices.empty()
    order = None if all_true(k_doc[1:] >= k_doc[:-1]) else torch.argsort(k_doc, stable=True)
    k_doc, k_row, k_pos, k_len = (take(x, order) for x in (k_doc, k_row, k_pos, k_len))
    first = torch.searchsorted(k_doc, q_doc, right=False)
    count = torch.searchsorted(k_doc, q_doc, right=True) - first
    qi = repeat(torch.arange(q_doc.numel()), count)
    ki = expand(first, count)
    return paired(q_row, q_pos, q_len, qi, take(k_row, ki), take(k_pos, ki), take(k_len, ki), mask)[0]


def paired(q_row: torch.Tensor, q_pos: torch.Tensor, q_len: torch.Tensor, qi: torch.Tensor,
           k_row: torch.Tensor, k_pos: torch.Tensor, k_len: torch.Tensor, mask: Mask, keys_seen: bool = False
           ) -> tuple[Slices, torch.Tensor | None]:
    """The slice of query segment ``qi[e]`` against key segment ``e`` (one document's), for every
    pair ``e``, trimmed to the rows and keys that can see each other (hulls: the kernels mask
    exactly); pairs that share no visible pair are dropped. Returns the slices and the pairs
    kept (an index into the pairs, or ``None`` for all), for callers that keep a column per pair
    (the ring: which rank's block the keys are in).

    Callers find the pairs their own way: :func:`pair_slices` by a join on the document, the ring
    by overlapping each query piece's visible keys with the blocks (``keys_seen``: every key of a
    pair is seen by some query of its segment, as all keys within a segment's hull are; only the
    queries are trimmed)."""
    qp0 = take(q_pos, qi)
    qp1, kp1 = qp0 + take(q_len, qi), k_pos + k_len
    if keys_seen:
        lo, hi = k_pos, kp1
    else:
        lo, hi = mask.visible_keys(qp0, qp1, kp1)
        lo = torch.maximum(lo, k_pos)
    qlo, qhi = mask.visible_queries(lo, hi, qp1)
    qlo, qhi = torch.maximum(qp0, qlo), torch.minimum(qp1, qhi)
    index = index_of(qhi > qlo if keys_seen else (hi > lo) & (qhi > qlo))
    qi, lo, hi, qlo, qhi = (take(t, index) for t in (qi, lo, hi, qlo, qhi))
    q0 = take(q_row - q_pos, qi) + qlo  # buffer row of position qlo (per segment: row - position)
    k0 = take(k_row, index) if keys_seen else take(k_row - k_pos, index) + lo
    return Slices(q0, q0 + (qhi - qlo), k0, k0 + (hi - lo), qlo, lo), index


def trim(slices: Slices, mask: BandMask) -> Slices:
    """Shrink every slice to the query rows that see some key and the keys some row sees (under
    a band: the kernels' own geometry); drop empty slices. Afterwards every row of a slice sees
    at least one of its keys, so no kernel call has an empty row (the cpu kernel would report
    lse 0 there, flash +inf)."""
    m, n = slices.q_end - slices.q_start, slices.k_end - slices.k_start
    qp, kp = slices.q_pos0, slices.k_pos0
    k_lo = torch.maximum(kp, qp - mask.left_bound)
    k_hi = torch.minimum(kp + n, qp + m + mask.right_bound)
    q_lo = torch.maximum(qp, kp - mask.right_bound)
    q_hi = torch.minimum(qp + m, kp + n + mask.left_bound)
    keep = (k_hi > k_lo) & (q_hi > q_lo)
    qs, ks = slices.q_start + (q_lo - qp), slices.k_start + (k_lo - kp)
    out = Slices(qs, qs + (q_hi - q_lo), ks, ks + (k_hi - k_lo), q_lo, k_lo)
    return out if all_true(keep) else out.select(keep)
