"""ShardedKVCache: per sequence, its cached K/V spread over the CP ranks.

Two halves, kept apart:

- **where** (the same on every rank): every rank's :class:`Runs` of every sequence. Prefill
  puts new tokens where the plan put them; decode hands sequence b's token of step s to
  rank ``(b + s) % N``, so each sequence grows by one token per rank every N steps (per
  sequence, ranks' decoded counts stay within one token) and each step spreads the batch's
  new tokens evenly over the ranks. Every rank can compute every other rank's sizes from
  this, so no collective ever exchanges sizes.
- **what** (this rank only): the K/V rows. Each sequence owns a region of one preallocated
  buffer, in position order, so a sequence's keys on a rank are contiguous rows::

      buffer   [ seq0: 0 1 2 6 8 _ _ _ | seq1: 3 4 _ _ | (free) ... ]
      region   start, capacity per sequence; rows in use = tokens this rank holds

  A full region grows by 1.5x: in place if it is the last one, else by moving to fresh
  space (copying that sequence only). When the buffer is full, every region in use gets
  1.5x its rows and all are compacted into a new buffer 1.25x their size (the same size when
  moved regions left enough garbage). Both are geometric, so appending costs amortised O(1)
  rows copied per token, never the whole cache per step, and the buffer stays within about
  twice the tokens held. ``capacity`` preallocates rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from doccp import comm
from doccp.agreement import tensor_hash
from doccp.device_copies import to_device
from doccp.kernels.nonfinite import all_finite
from doccp.kernels.runs import Runs
from doccp.masks import Mask
from doccp.plan import Plan
from doccp.ranges import expand, offsets_within, starts

#: Smallest region a sequence gets (rows), so early decode steps do not move regions.
MIN_REGION = 16


def _grown(size):
    """A full region grows by 1.5x (the buffer by 1.25x): rows copied per cached token stay
    O(1), and memory stays within about twice the tokens held."""
    return size + (size + 1) // 2


class ShardedKVCache:
    """The KV cache of one attention layer under CP (see module docstring).

    ``ShardedKVCache(world_size, rank)`` (or :meth:`for_group`) is empty; the first
    :func:`doccp.prefill` (or :meth:`append`) fixes the number of sequences (the plan's
    documents), the KV shape, dtype, device and the mask. ``capacity`` preallocates rows.
    :attr:`finite` says whether every row cached so far (through :meth:`append` and decode) is
    finite: on CPU each row is checked once, as it arrives, and a decode step over a finite cache
    then checks only its queries for NaN/inf (:mod:`doccp.kernels.nonfinite`), not every cached row.
    """

    def __init__(self, world_size: int, rank: int, capacity: int = 0):
        for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0), ("capacity", capacity, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.world_size, self.rank = world_size, rank
        self.num_seqs: int | None = None
        self.mask: Mask | None = None
        self.step = 0  # decode steps so far: the round-robin offset
        self.runs = Runs.empty()  # every rank's runs; row = offset among that rank's rows of the sequence
        self.counts = torch.zeros(world_size, 0, dtype=torch.int64)  # [N, B] tokens held per rank
        self._last = torch.zeros(world_size, 0, dtype=torch.int64)  # [N, B] index of the last run, -1 if none
        self._capacity = capacity
        self.k: torch.Tensor | None = None  # [capacity, Hkv, D]
        self.v: torch.Tensor | None = None
        self.finite = True  # every row written so far is finite (checked as it arrives, on CPU only)
        self._start = self._cap = torch.zeros(0, dtype=torch.int64)  # region of each sequence
        self._top = 0  # end of the allocated part of the buffer
        self.reallocations = 0  # times the buffer was replaced (a whole-cache copy)
        self.rows_copied = 0  # rows moved by growing, all told (amortised O(1) per token)

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None = None, capacity: int = 0) -> ShardedKVCache:
        """An empty cache for this process's rank in ``group``."""
        return cls(comm.size(group), comm.rank(group), capacity)

    # -- what is cached --------------------------------------------------------------------
    @property
    def lengths(self) -> torch.Tensor:
        """Cached tokens of every sequence (all ranks together), ``[B]`` int64."""
        return self.counts.sum(0)

    @property
    def capacity(self) -> int:
        """Rows allocated on this rank."""
        return 0 if self.k is None else self.k.shape[0]

    @property
    def kv_shape(self) -> tuple[int, int] | None:
        """``(n_kv_heads, head_dim)`` once something was cached."""
        return None if self.k is None else (self.k.shape[1], self.k.shape[2])

    def describe(self) -> str:
        """The state every rank's cache must share (what is cached where, decode steps), in one line."""
        seqs = "empty" if self.num_seqs is None else f"{self.num_seqs} sequences, {int(self.lengths.sum())} tokens"
        return (f"ShardedKVCache(world_size={self.world_size}, {seqs}, {self.step} decode steps, mask {self.mask}, "
                f"layout hash {tensor_hash(self.counts) & (2**64 - 1):016x})")

    def rank_lengths(self) -> torch.Tensor:
        """``[N, B]``: tokens of each sequence held by each rank."""
        return self.counts.clone()

    def positions(self, rank: int, seq: int) -> torch.Tensor:
        """Document positions of ``seq`` cached on ``rank``, in the order of that rank's rows."""
        runs = self.runs.select((self.runs.rank == rank) & (self.runs.doc == seq))
        return runs.select(torch.argsort(runs.row)).positions()

    def local_kv(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's cached K and V of ``seq`` (views, rows in :meth:`positions` order)."""
        if self.k is None or self.v is None:
            raise ValueError("the cache is empty")
        start, used = int(self._start[seq]), int(self.counts[self.rank, seq])
        return self.k[start:start + used], self.v[start:start + used]

    def local_runs(self) -> Runs:
        """This rank's runs, with ``row`` = rows of :attr:`k` / :attr:`v`."""
        mine = self.runs.select(self.runs.rank == self.rank)
        return Runs(mine.rank, mine.doc, self._start[mine.doc] + mine.row, mine.pos, mine.length, mine.stride)

    def buffer_rows(self, runs: Runs) -> torch.Tensor:
        """Rows of :attr:`k` / :attr:`v` holding this rank's ``runs`` (rows = offsets in the sequence)."""
        return expand(self._start[runs.doc] + runs.row, runs.length, torch.ones_like(runs.row))

    def decode_ranks(self) -> torch.Tensor:
        """Rank that stores each sequence's KV of the next decode step: ``(b + step) % N``."""
        return (torch.arange(self.counts.shape[1]) + self.step) % self.world_size

    def problem(self, group: dist.ProcessGroup | None, k: torch.Tensor | None = None, plan: Plan | None = None
                ) -> BaseException | None:
        """What is wrong (returned, not raised) with using this cache on ``group``: a cache of
        another world size or rank, or (see :meth:`fit_problem`) keys or a plan that do not fit."""
        if comm.size(group) != self.world_size:
            return ValueError(f"the KV cache is for world_size={self.world_size} but the process group has "
                              f"{comm.size(group)} ranks; make it with ShardedKVCache.for_group(group)")
        if comm.rank(group) != self.rank:
            return ValueError(f"this KV cache belongs to rank {self.rank}, but this process is rank "
                              f"{comm.rank(group)} of the group; make it with ShardedKVCache.for_group(group)")
        return self.fit_problem(k, plan)

    def fit_problem(self, k: torch.Tensor | None = None, plan: Plan | None = None) -> BaseException | None:
        """What is wrong (returned, not raised) with caching keys like ``k`` laid out by ``plan``."""
        if plan is not None:
            if plan.world_size != self.world_size:
                return ValueError(f"the plan is for world_size={plan.world_size} but the KV cache for "
                                  f"world_size={self.world_size}")
            if self.num_seqs is not None and plan.layout.num_docs != self.num_seqs:
                return ValueError(f"sequence count mismatch: the plan's layout has {plan.layout.num_docs} documents "
                                  f"but the cache holds {self.num_seqs} sequences; give every sequence a document "
                                  "(length 0 for sequences without new tokens), in the cache's order")
            if self.mask is not None and plan.mask != self.mask:
                return ValueError(f"the plan's mask is {plan.mask} but the cache was filled under {self.mask}; "
                                  "use one mask per cache")
        if k is not None and self.k is not None:
            if tuple(k.shape[1:]) != self.kv_shape:
                return ValueError(f"k/v have [n_kv_heads, head_dim] = {list(k.shape[1:])}, but the cache holds "
                                  f"{list(self.kv_shape)}")
            if k.dtype != self.k.dtype or k.device != self.k.device:
                return TypeError(f"k/v are {k.dtype} on {k.device}, but the cache holds {self.k.dtype} on "
                                 f"{self.k.device}")
        return None

    # -- appending ---------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> None:
        """Cache new tokens' KV where ``plan`` put them, after each sequence's cached tokens.

        ``k``/``v`` are this rank's shards ``[T_local, Hkv, D]``; the plan's documents are the
        sequences. :func:`doccp.prefill` calls this (collectively checked); on its own it loads
        KV without attention, e.g. a cache saved earlier: call it on every rank with the same
        plan (its checks are local).
        """
        problem = self.fit_problem(k, plan)
        if problem is None and (k.shape != v.shape or k.dim() != 3 or k.shape[0] != plan.local_sizes[self.rank]):
            problem = ValueError(f"k and v must both be [{plan.local_sizes[self.rank]}, n_kv_heads, head_dim] (this "
                                 f"rank's tokens of the plan), got {tuple(k.shape)} and {tuple(v.shape)}")
        if problem is not None:
            raise problem
        if self.num_seqs is None:
            self._init(plan, k)
        p = plan.all_pieces  # ordered by (rank, doc, start)
        group = p.rank * self.num_seqs + p.doc
        row = self.counts[p.rank, p.doc] + offsets_within(group, p.length)
        new = Runs(p.rank, p.doc, row, self.lengths[p.doc] + p.start, p.length, torch.ones_like(p.doc))
        mine = new.select(new.rank == self.rank)
        extra = torch.zeros(self.num_seqs, dtype=torch.int64).index_add_(0, mine.doc, mine.length)
        self._reserve(extra)
        self._write(self.buffer_rows(mine), k, v)
        self.counts.view(-1).index_add_(0, group, p.length)
        first = len(self.runs)
        self.runs = Runs.cat([self.runs, new])
        self._last.view(-1).scatter_reduce_(0, group, first + torch.arange(len(new)), "amax")

    def append_decoded(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Cache one new token per sequence (``k``/``v`` ``[B, Hkv, D]``, the same on every
        rank) on the round-robin ranks; returns the tokens' positions. :func:`doccp.decode`
        calls this."""
        b = torch.arange(self.num_seqs)
        dest, pos = self.decode_ranks(), self.lengths
        row = self.counts[dest, b]
        mine = dest == self.rank
        extra = mine.long()
        self._reserve(extra)
        self._write(self._start[mine] + row[mine], k[mine], v[mine])
        # extend each sequence's last run on its rank when the position continues its stride
        last = self._last[dest, b]
        has = last >= 0
        idx = last.clamp(min=0)
        # (a cache of empty prompts only has no run to read; ``has`` is all false there)
        r_pos, r_len, r_stride = (c[idx] if len(self.runs) else torch.zeros_like(idx)
                                  for c in (self.runs.pos, self.runs.length, self.runs.stride))
        start_stride = has & (r_len == 1) & (r_pos < pos)
        extend = start_stride | (has & (r_len > 1) & (r_pos + r_stride * r_len == pos))
        self.runs.stride[idx[start_stride]] = (pos - r_pos)[start_stride]
        self.runs.length[idx[extend]] += 1
        fresh = ~extend
        first = len(self.runs)
        self.runs = Runs.cat([self.runs, Runs.of(dest[fresh], b[fresh], row[fresh], pos[fresh], 1, 1)])
        self._last[dest[fresh], b[fresh]] = first + torch.arange(int(fresh.sum()))
        self.counts[dest, b] += 1
        self.step += 1
        return pos

    # -- storage -----------------------------------------------------------------------------
    def _init(self, plan: Plan, k: torch.Tensor) -> None:
        self.num_seqs, self.mask = plan.layout.num_docs, plan.mask
        self.counts = torch.zeros(self.world_size, self.num_seqs, dtype=torch.int64)
        self._last = torch.full((self.world_size, self.num_seqs), -1, dtype=torch.int64)
        self._start = torch.zeros(self.num_seqs, dtype=torch.int64)
        self._cap = torch.zeros(self.num_seqs, dtype=torch.int64)
        # zeros, not uninitialised memory: rows not yet written are never attended to, but a NaN
        # pattern there would send every CPU attention over the cache through the slow non-finite path
        self.k = k.new_zeros(self._capacity, *k.shape[1:])
        self.v = k.new_zeros(self._capacity, *k.shape[1:])

    def _write(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # What a CPU attention over the cache would otherwise check on every call: its whole buffer,
        # now only the new rows (O(new tokens) a step). Unwritten rows are zeros and moves copy
        # written rows, so the flag covers the buffer. (On a GPU no kernel checks: a check would sync.)
        if self.finite and self.k.device.type == "cpu":
            self.finite = all_finite(k, v)
        rows = to_device(rows, self.k.device)
        self.k.index_copy_(0, rows, k.detach())
        self.v.index_copy_(0, rows, v.detach())

    def _reserve(self, extra: torch.Tensor) -> None:
        """Make room for ``extra[b]`` more rows of every sequence b on this rank."""
        used = self.counts[self.rank]
        want = used + extra
        grow = want > self._cap
        if not bool(grow.any()):
            return
        cap = torch.where(grow, torch.maximum(_grown(self._cap), want).clamp(min=MIN_REGION), self._cap)
        at_top = grow & (self._cap > 0) & (self._start + self._cap == self._top)  # can grow where it is
        moving = (grow & ~at_top).nonzero().flatten()
        extended = int((cap - self._cap)[at_top].sum())
        added = int(cap[moving].sum())
        if self._top + extended + added <= self.capacity:  # grow in place, or move to fresh space
            start = self._start.clone()
            start[moving] = self._top + extended + torch.cumsum(cap[moving], 0) - cap[moving]
            self._move(moving, start, self.k, self.v)
            self._top += extended + added
        else:  # compact all regions (those already in use get room to grow) into a new buffer
            cap = torch.where(used > 0, torch.maximum(cap, _grown(want)), cap)
            total = int(cap.sum())
            size = self.capacity if total <= self.capacity * 3 // 4 else total + total // 4
            start = starts(cap)
            k, v = (x.new_zeros(size, *x.shape[1:]) for x in (self.k, self.v))
            self._move(torch.arange(self.num_seqs), start, k, v)
            self.k, self.v, self._top = k, v, total
            self.reallocations += 1
        self._start, self._cap = start, cap

    def _move(self, seqs: torch.Tensor, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the used rows of ``seqs`` from their regions to ``start`` (in ``k``/``v``)."""
        used = self.counts[self.rank, seqs]
        self.rows_copied += int(used.sum())
        one = torch.ones_like(used)
        src = to_device(expand(self._start[seqs], used, one), k.device)
        dst = to_device(expand(start[seqs], used, one), k.device)
        k.index_copy_(0, dst, self.k.index_select(0, src))
        v.index_copy_(0, dst, self.v.index_select(0, src))

    def __repr__(self) -> str:
        seqs = "empty" if self.num_seqs is None else f"{self.num_seqs} sequences, {int(self.lengths.sum())} tokens"
        return f"ShardedKVCache(rank {self.rank} of {self.world_size}, {seqs}, {self.capacity} rows allocated)"
