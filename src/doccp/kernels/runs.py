"""Runs: which document positions a buffer's rows hold, a few rows per entry.

A *run* is ``length`` consecutive buffer rows holding document positions ``pos, pos + stride,
pos + 2*stride, ...``. Every CP algorithm describes its buffers this way: a rank's local
tokens (its plan pieces), the KV it received or holds in a cache, a block travelling the ring
are runs of stride 1, and :meth:`Runs.slices_against` pairs query runs with key runs into kernel
slices. The tokens a rank receives during decode are one run of stride N, because the
round-robin hands every N-th token of a sequence to the same rank::

    one sequence, N = 2: prompt of 6 tokens (plan: rank 0 holds 0..2, rank 1 holds 3..5), 4 decoded
    rank 0 rows   0 1 2 | 6 8          runs  (pos 0, len 3, stride 1)  (pos 6, len 2, stride 2)
    rank 1 rows   3 4 5 | 7 9          runs  (pos 3, len 3, stride 1)  (pos 7, len 2, stride 2)

So a rank's part of a sequence stays a handful of runs however long it decodes. Attention
over runs (:func:`work`) uses the kernels' exact masked slices where positions are
consecutive; strided keys that every query of the document sees become one unmasked slice,
and only strided keys on a window's edge are taken one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from doccp.kernels.slices import Slices, pair_slices
from doccp.masks import UNBOUNDED, Mask
from doccp.ranges import expand, index_of, repeat, starts, take

#: An empty hull is ``(BIG, -BIG)``: beyond any position plus any mask bound (``UNBOUNDED``).
BIG = 4 * UNBOUNDED
FULL = Mask.full()

#: Kernel work against one pair of q and k/v buffers: ``(slices, mask)`` parts whose partial
#: results merge by log-sum-exp (decode adds an unmasked part for strided keys).
Work = list[tuple[Slices, Mask]]


@dataclass(frozen=True)
class Runs:
    """Columns of int64 CPU tensors, one entry per run (see module docstring). ``rank`` says
    who holds it; ``row`` is its first row in whatever buffer the context names."""

    rank: torch.Tensor
    doc: torch.Tensor
    row: torch.Tensor
    pos: torch.Tensor
    length: torch.Tensor
    stride: torch.Tensor

    @classmethod
    def of(cls, rank, doc, row, pos, length, stride=1) -> Runs:
        cols = [torch.as_tensor(c, dtype=torch.int64).reshape(-1) for c in (rank, doc, row, pos, length, stride)]
        n = min((c.numel() for c in cols if c.numel() != 1), default=1)  # single values broadcast
        return cls(*(c.expand(n).clone() if c.numel() == 1 else c for c in cols))

    @classmethod
    def laid_out(cls, doc: torch.Tensor, pos: torch.Tensor, length: torch.Tensor, row0: int = 0,
                 rank: int = 0) -> Runs:
        """Stride-1 runs of ``(doc, pos, length)`` laid out back to back from buffer row ``row0``."""
        one = torch.ones_like(doc)
        return cls(one * rank, doc, row0 + starts(length), pos, length, one)

    @classmethod
    def empty(cls) -> Runs:
        return cls(*(torch.zeros(0, dtype=torch.int64) for _ in range(6)))

    @classmethod
    def cat(cls, parts: list[Runs]) -> Runs:
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls))) if parts else cls.empty()

    def __len__(self) -> int:
        return self.doc.numel()

    def select(self, keep) -> Runs:
        index = index_of(keep)
        return self if index is None else Runs(*(take(getattr(self, f.name), index) for f in fields(self)))

    @property
    def end(self) -> torch.Tensor:
        """One past the last position of each run."""
        return self.pos + self.stride * (self.length - 1) + 1

    @property
    def dense(self) -> torch.Tensor:
        """Runs whose positions are consecutive (what the kernels' masked slices describe)."""
        return (self.stride == 1) | (self.length <= 1)

    def clip(self, lo: torch.Tensor, hi: torch.Tensor) -> Runs:
        """The part of each run whose positions lie in ``[lo, hi)`` (per run); empty parts dropped."""
        first = _ceil_div((lo - self.pos).clamp(min=0), self.stride).minimum(self.length)
        stop = _ceil_div((hi - self.pos).clamp(min=0), self.stride).minimum(self.length)
        out = Runs(self.rank, self.doc, self.row + first, self.pos + first * self.stride, stop - first, self.stride)
        return out.select(out.length > 0)

    def packed(self, row0: int = 0) -> Runs:
        """The same runs laid out back to back from buffer row ``row0`` (how blocks travel)."""
        return Runs(self.rank, self.doc, row0 + starts(self.length), self.pos, self.length,
                    self.stride)

    def rows(self) -> torch.Tensor:
        """Buffer row of every token, run after run."""
        return expand(self.row, self.length, torch.ones_like(self.row))

    def positions(self) -> torch.Tensor:
        """Document position of every token, run after run."""
        return expand(self.pos, self.length, self.stride)

    def explode(self) -> Runs:
        """One run per token (each trivially dense)."""
        index = repeat(torch.arange(len(self)), self.length)
        one = torch.ones_like(index)
        return Runs(self.rank[index], self.doc[index], self.rows(), self.positions(), one, one)

    def hull(self, size: int, key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per ``key`` (default: doc) in ``[0, size)``: ``[min pos, max end)``; ``(BIG, -BIG)``
        where no run has that key."""
        key = self.doc if key is None else key
        lo = torch.full((size,), BIG, dtype=torch.int64).scatter_reduce(0, key, self.pos, "amin")
        hi = torch.full((size,), -BIG, dtype=torch.int64).scatter_reduce(0, key, self.end, "amax")
        return lo, hi

    @property
    def extent(self) -> int:
        """Buffer rows up to the end of the last run."""
        return int((self.row + self.length).max()) if len(self) else 0

    def locate(self, doc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Buffer row of each ``(doc, pos)`` (stride-1 runs; every position must be held)."""
        big = int(torch.cat([self.pos + self.length, pos]).max()) + 1
        key = self.doc * big + self.pos
        order = torch.argsort(key)
        i = order[torch.searchsorted(key[order], doc * big + pos, right=True) - 1]
        return self.row[i] + (pos - self.pos[i])

    def rows_of(self, doc: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Buffer rows of the document ranges ``[start, end)``, concatenated in order."""
        length = end - start
        return self.locate(repeat(doc, length), expand(start, length))

    def slices_against(self, keys: Runs, mask: Mask) -> Slices:
        """Kernel slices of these (stride-1) query runs against stride-1 key runs under ``mask``."""
        return pair_slices(self.doc, self.row, self.pos, self.length, keys.doc, keys.row, keys.pos, keys.length, mask)


def keys_seen(mask: Mask, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hull of the keys the queries of the hulls ``[lo, hi)`` see: the first query's first key
    to the last query's last (a monotone interval mask); empty hulls stay empty."""
    return mask.visible_keys(lo, lo + 1, BIG)[0], mask.visible_keys(hi - 1, hi, BIG)[1]


def queries_seeing(mask: Mask, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hull of the queries that see some key of the hulls ``[lo, hi)``; empty hulls stay empty."""
    return mask.visible_queries(lo, lo + 1, BIG)[0], mask.visible_queries(hi - 1, hi, BIG)[1]


def clip_to_others(runs: Runs, lo: torch.Tensor, hi: torch.Tensor, rank: int, n: int) -> Runs:
    """``runs`` of ``rank`` clipped, per sequence, to the hull ``[lo, hi)`` of all *other* ranks
    (``lo``/``hi`` are ``[n * seqs]`` hulls per (rank, sequence)): what of them another rank can use."""
    lo, hi = lo.view(n, -1).clone(), hi.view(n, -1).clone()
    lo[rank], hi[rank] = BIG, -BIG
    return runs.clip(lo.min(0).values[runs.doc], hi.max(0).values[runs.doc])


def work(queries: Runs, keys: Runs, mask: Mask) -> Work:
    """Exact kernel work of query runs (stride 1) against key runs of the same documents.

    Dense keys get masked slices. Strided keys are split by what the queries of their
    document (their hull ``[qlo, qhi)``) see: keys from the last query's first visible key to
    the first query's last one are seen by every query (the mask is a monotone interval mask)
    and get one unmasked slice per run; keys seen by only some queries are taken one by one
    (masked); keys seen by none are dropped.
    """
    if not len(queries) or not len(keys):
        return []
    size = int(max(queries.doc.max(), keys.doc.max())) + 1
    qlo, qhi = queries.hull(size)
    strided = keys.select(~keys.dense)
    strided = strided.select(qhi[strided.doc] > qlo[strided.doc])
    lo, hi = qlo[strided.doc], qhi[strided.doc]
    seen_lo, first_hi = mask.visible_keys(lo, lo + 1, BIG)
    full_lo, seen_hi = mask.visible_keys(hi - 1, hi, BIG)
    full_hi = torch.maximum(torch.as_tensor(first_hi), torch.as_tensor(full_lo))
    exact = Runs.cat([keys.select(keys.dense), strided.clip(seen_lo, full_lo).explode(),
                      strided.clip(full_hi, seen_hi).explode()])
    full = strided.clip(full_lo, full_hi)
    parts = [(queries.slices_against(exact, mask), mask), (queries.slices_against(full, FULL), FULL)]
    return [(s, m) for s, m in parts if len(s)]


def _ceil_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return -torch.div(-a, b, rounding_mode="floor")
