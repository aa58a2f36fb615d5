"""Runs: where KV rows of a sequence sit and which positions they hold, a few rows per turn.

A *run* is ``length`` consecutive buffer rows holding document positions ``pos, pos + stride,
pos + 2*stride, ...``. Prefill chunks are runs of stride 1 (the training *segments*); the
tokens a rank receives during decode are one run of stride N, because the round-robin hands
every N-th token of a sequence to the same rank::

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

from doccp.algorithms.work import Work
from doccp.kernels.slices import pair_slices
from doccp.masks import UNBOUNDED, Mask

#: An empty hull is ``(BIG, -BIG)``: beyond any position plus any mask bound (``UNBOUNDED``).
BIG = 4 * UNBOUNDED
FULL = Mask.full()


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
    def empty(cls) -> Runs:
        return cls(*(torch.zeros(0, dtype=torch.int64) for _ in range(6)))

    @classmethod
    def cat(cls, parts: list[Runs]) -> Runs:
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls))) if parts else cls.empty()

    def __len__(self) -> int:
        return self.doc.numel()

    def select(self, keep) -> Runs:
        return Runs(*(getattr(self, f.name)[keep] for f in fields(self)))

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
        return Runs(self.rank, self.doc, row0 + torch.cumsum(self.length, 0) - self.length, self.pos, self.length,
                    self.stride)

    def rows(self) -> torch.Tensor:
        """Buffer row of every token, run after run."""
        return spread(self.row, self.length, torch.ones_like(self.row))

    def positions(self) -> torch.Tensor:
        """Document position of every token, run after run."""
        return spread(self.pos, self.length, self.stride)

    def explode(self) -> Runs:
        """One run per token (each trivially dense)."""
        index = torch.repeat_interleave(torch.arange(len(self)), self.length)
        one = torch.ones_like(index)
        return Runs(self.rank[index], self.doc[index], self.rows(), self.positions(), one, one)

    def hull(self, size: int, key: torch.Tensor | None = None, below: int = 0, above: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per ``key`` (default: doc) in ``[0, size)``: ``[min pos - below, max end + above)``;
        ``(BIG, -BIG)`` where no run has that key."""
        key = self.doc if key is None else key
        lo = torch.full((size,), BIG, dtype=torch.int64).scatter_reduce(0, key, self.pos - below, "amin")
        hi = torch.full((size,), -BIG, dtype=torch.int64).scatter_reduce(0, key, self.end + above, "amax")
        return lo, hi

    def segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(doc, row, pos, length)`` columns for :func:`pair_slices`."""
        return self.doc, self.row, self.pos, self.length


def spread(first: torch.Tensor, counts: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``cat([first[i] + step[i] * arange(counts[i]) for i])`` without a Python loop."""
    total = int(counts.sum())
    index = torch.repeat_interleave(torch.arange(first.numel()), counts, output_size=total)
    within = torch.arange(total) - (torch.cumsum(counts, 0) - counts)[index]
    return first[index] + step[index] * within


def offsets_within(group: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """For entries sorted by ``group``: how many tokens of the same group come before each."""
    before = torch.cumsum(length, 0) - length
    first = torch.ones_like(group, dtype=torch.bool)
    first[1:] = group[1:] != group[:-1]
    start = torch.cummax(torch.where(first, torch.arange(group.numel()), 0), 0).values
    return before - before[start]


def work(queries: Runs, keys: Runs, mask: Mask) -> Work:
    """Exact kernel work of query runs (stride 1) against key runs of the same documents.

    Dense keys get masked slices. Strided keys are split by what the queries of their
    document (their hull ``[qlo, qhi)``) see: keys in ``[qhi-1-left, qlo+right]`` are seen by
    every query and get one unmasked slice per run; keys seen by only some queries are
    taken one by one (masked); keys seen by none are dropped.
    """
    if not len(queries) or not len(keys):
        return []
    size = int(max(queries.doc.max(), keys.doc.max())) + 1
    qlo, qhi = queries.hull(size)
    strided = keys.select(~keys.dense)
    strided = strided.select(qhi[strided.doc] > qlo[strided.doc])
    lo, hi = qlo[strided.doc], qhi[strided.doc]
    seen_lo, seen_hi = lo - mask.left_bound, hi + mask.right_bound
    full_lo = hi - 1 - mask.left_bound
    full_hi = torch.maximum(lo + mask.right_bound + 1, full_lo)
    exact = Runs.cat([keys.select(keys.dense), strided.clip(seen_lo, full_lo).explode(),
                      strided.clip(full_hi, seen_hi).explode()])
    full = strided.clip(full_lo, full_hi)
    parts = [(pair_slices(*queries.segments(), *exact.segments(), mask), mask),
             (pair_slices(*queries.segments(), *full.segments(), FULL), FULL)]
    return [(s, m) for s, m in parts if len(s)]


def _ceil_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return -torch.div(-a, b, rounding_mode="floor")
