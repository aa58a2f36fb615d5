"""Who holds which tokens: :func:`plan` turns a layout into a :class:`Plan` of pieces.

A plan lists, for each CP rank, ordered pieces ``(doc, start, end)``; the rank's local
tokens are its pieces concatenated. Everything else follows from the pieces: gather
indices, RoPE positions, per-rank work, and which remote KV each rank needs.

Host cost: every rank plans every batch, so a plan is stored in stream order (the pieces
tile the stream; see :mod:`doccp.plan.pieces`) and one rank's view is one filter of that
table, O(pieces). The rank-ordered table (:attr:`Plan.all_pieces`) is one stable sort,
built only when something needs every rank at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan.balanced import balanced
from doccp.plan.exchange import Intervals, group_ends, kv_exchange, sees_from_key_zero, visible_intervals
from doccp.plan.head_tail import head_tail
from doccp.plan.pieces import Pieces, cut_stream, even_sizes
from doccp.ranges import any_true, expand, repeat, spans, stable_order, starts, take

__all__ = ["Plan", "PlanStats", "plan", "STRATEGIES", "Pieces", "Intervals"]

TILE = 128
#: Query tiles :func:`_tile_counts` takes at a time (its memory: a few dozen bytes per tile).
TILE_BATCH = 1 << 16
#: Most ranks a plan is made for (per-rank tables are allocated up front).
MAX_WORLD_SIZE = 1 << 16


def contiguous(layout: DocLayout, world_size: int, mask: Mask | None = None) -> Pieces:
    """The stream cut into ``world_size`` equal contiguous ranges (the unbalanced baseline)."""
    return cut_stream(layout.cu_seqlens, even_sizes(layout.num_tokens, world_size))


Strategy = Callable[[DocLayout, int, Mask], Pieces]
STRATEGIES: dict[str, Strategy] = {"contiguous": contiguous, "head_tail": head_tail, "balanced": balanced}


def plan(layout: DocLayout, world_size: int, mask: Mask | None = None,
         strategy: str = "balanced") -> Plan:
    """Assign every token of ``layout`` to one of ``world_size`` ranks.

    Strategies: ``"contiguous"`` (baseline), ``"head_tail"`` (every document in 2N chunks)
    and ``"balanced"`` (balanced work, short documents whole, little KV to exchange). All
    give equal token counts per rank (within one), zero padding, every token exactly once.
    """
    if not isinstance(layout, DocLayout):
        raise TypeError(f"layout must be a doccp.DocLayout, got {type(layout).__name__}; "
                        "build one with DocLayout.from_lengths / from_cu_seqlens")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
    mask = Mask.causal() if mask is None else mask
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a doccp.Mask, got {type(mask).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    pieces = STRATEGIES[strategy](layout, world_size, mask)
    result = Plan(layout, world_size, mask, strategy, pieces)
    if not _partitions(result, normalized=True):  # strategies that emit normalized pieces skip the sort
        result = Plan(layout, world_size, mask, strategy, pieces.stream_normalized())
        if not _partitions(result):
            raise RuntimeError(f"strategy {strategy!r} did not partition the stream (a bug in doccp.plan)")
    return result


def _partitions(plan: Plan, normalized: bool = False) -> bool:
    """Whether the plan's pieces, read in the order given, tile the stream exactly (O(pieces);
    guards the strategies); with ``normalized``, also that no piece is empty and no two touching
    pieces of one document share a rank (:meth:`Pieces.stream_normalized` would change nothing)."""
    p, layout = plan.stream_pieces, plan.layout
    if layout.num_tokens == 0 or len(p) == 0:
        return len(p) == 0 and layout.num_tokens == 0
    g0, g1 = plan.stream_bounds  # (reductions of the values, not tests of masks: see ranges.all_true)
    if not (int(g0[0]) == 0 and int(g1[-1]) == layout.num_tokens and torch.equal(g0[1:], g1[:-1])):
        return False
    for a, b in spans(len(p)):  # (the tests' tables stay in cache)
        c = min(b, len(p) - 1)  # neighbour pairs [a, c)
        if int(p.start[a:b].min()) < 0 or int((p.end[a:b] - take(layout.lengths, p.doc[a:b])).max()) > 0:
            return False
        if normalized and (int((g1[a:b] - g0[a:b]).min()) <= 0 or any_true(
                (p.rank[a + 1:c + 1] == p.rank[a:c]).logical_and_(p.doc[a + 1:c + 1] == p.doc[a:c]))):
            return False
    return True


@dataclass(frozen=True)
class PlanStats:
    """Per-rank figures of a plan (lists indexed by rank) and their summaries."""

    tokens: list[int]
    work: list[int]
    pieces: list[int]
    kv_recv: list[int]
    tile_work: list[int]
    imbalance: float
    tile_imbalance: float
    total_work: int
    num_tokens: int

    @property
    def max_kv_fraction(self) -> float:
        """Max KV tokens received by a rank, as a fraction of a full all-gather (T - T_local)."""
        n = len(self.tokens)
        if n == 1:
            return 0.0
        allgather = max(self.num_tokens - min(self.tokens), 1)
        return max(self.kv_recv) / allgather

    def table(self) -> str:
        rows = [f"{'rank':>4} {'tokens':>8} {'work':>14} {'work/mean':>9} {'pieces':>6} {'kv_recv':>8}"]
        mean = max(self.total_work / len(self.tokens), 1)
        for r, (t, w, p, kv) in enumerate(zip(self.tokens, self.work, self.pieces, self.kv_recv, strict=True)):
            rows.append(f"{r:>4} {t:>8} {w:>14,} {w / mean:>9.3f} {p:>6} {kv:>8}")
        rows.append(f"imbalance (max/mean work) {self.imbalance:.4f}   "
                    f"max KV received {self.max_kv_fraction:.1%} of an all-gather")
        return "\n".join(rows)


class Plan:
    """Pieces per rank for one layout (see :func:`plan`). Immutable; derived data is cached.

    ``stream_pieces`` are the plan's pieces in stream order (normalised: touching pieces of
    one rank merged); :attr:`all_pieces` the same pieces in rank order.
    """

    def __init__(self, layout: DocLayout, world_size: int, mask: Mask, strategy: str, stream_pieces: Pieces):
        self.layout, self.world_size, self.mask, self.strategy = layout, world_size, mask, strategy
        self.stream_pieces = stream_pieces
        self._ranks: dict[int, Pieces] = {}
        self._masked: dict[Mask, Plan] = {}

    def with_mask(self, mask: Mask) -> Plan:
        """The same pieces under another mask, built once per mask: the pieces decide who holds
        which tokens, the mask who sees what, so one batch plan serves every layer of a model
        that mixes masks (sliding-window and full layers); its schedules are cached per mask."""
        if mask == self.mask:
            return self
        if mask not in self._masked:
            self._masked[mask] = Plan(self.layout, self.world_size, mask, self.strategy, self.stream_pieces)
        return self._masked[mask]

    # -- per rank ------------------------------------------------------------------------
    def check_rank(self, rank: int) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``rank`` is a rank of this plan."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}) for this plan, got {rank}")

    def rank_pieces(self, rank: int) -> Pieces:
        """Pieces of ``rank`` ordered by (doc, start). The first rank asked filters the stream
        table (O(pieces)); once a second rank asks, the rank-ordered table is built and every
        rank is a slice of it."""
        self.check_rank(rank)
        if rank not in self._ranks:
            if "all_pieces" in self.__dict__ or self._ranks:
                a, b = self.rank_bounds[rank], self.rank_bounds[rank + 1]
                self._ranks[rank] = self.all_pieces.select(slice(a, b))
            else:
                self._ranks[rank] = self.stream_pieces.select(self.stream_pieces.rank == rank)
        return self._ranks[rank]

    @cached_property
    def stream_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Stream offsets ``[g0, g1)`` of :attr:`stream_pieces` (they tile ``[0, num_tokens)``)."""
        p = self.stream_pieces
        g0, g1 = torch.empty_like(p.start), torch.empty_like(p.end)
        for a, b in spans(len(p)):  # (one small table of document offsets at a time)
            base = take(self.layout.cu_seqlens, p.doc[a:b])
            torch.add(base, p.start[a:b], out=g0[a:b])
            torch.add(base, p.end[a:b], out=g1[a:b])
        return g0, g1

    @cached_property
    def all_pieces(self) -> Pieces:
        """Every rank's pieces, ordered by (rank, doc, start)."""
        return self.stream_pieces.select(self.rank_order)

    @cached_property
    def rank_order(self) -> torch.Tensor:
        """Stream indices of every piece in rank order (by rank, then stream order): one stable
        sort by rank, the permutation every per-rank layout of the plan's pieces starts from."""
        return stable_order(self.stream_pieces.rank, self.world_size)

    def stream_index(self, rank: int) -> torch.Tensor:
        """Stream indices of the pieces of ``rank``, ascending (its pieces in (doc, start) order):
        a slice of the rank order."""
        self.check_rank(rank)
        return self.rank_order[self.rank_bounds[rank]:self.rank_bounds[rank + 1]]

    @cached_property
    def causal_like(self) -> bool:
        """Whether every query sees its document from key 0 up to itself and no later key (the
        causal mask): then a rank sees a document up to the end of its last piece there."""
        lengths = self.layout.lengths
        last_query = max(int(lengths.max()) - 1, 0) if lengths.numel() else 0
        return not self.mask.looks_ahead and sees_from_key_zero(self.mask, last_query)

    @cached_property
    def last_pieces(self) -> torch.Tensor:
        """Stream indices of every (rank, doc) group's last piece, ascending (under a causal mask
        a rank sees a document up to the end of its last piece there: :attr:`causal_like`)."""
        last = torch.zeros(len(self.stream_pieces), dtype=torch.bool)
        last.index_fill_(0, group_ends(self.stream_pieces, self.rank_order), True)
        return torch.nonzero(last).squeeze(1)

    def pieces_before(self, rank: int) -> torch.Tensor:
        """For every stream piece, how many pieces of ``rank`` come earlier in the stream (for the
        rank's own pieces: their local index). One pass over the stream table, no search: what the
        ring's schedule under a causal mask asks of every other rank's pieces is which of its own
        come after them."""
        self.check_rank(rank)
        before = torch.zeros(len(self.stream_pieces) + 1, dtype=torch.int64)
        torch.cumsum(self.stream_pieces.rank == rank, 0, out=before[1:])
        return before[:-1]

    def rank_offsets(self, sizes: torch.Tensor) -> torch.Tensor:
        """Where entries sit in per-rank buffers: ``sizes`` holds ``k`` entries per stream piece
        (shape ``[pieces]`` or ``[pieces, k]``), every rank lays out the entries of its pieces in
        stream order (a piece's ``k`` in turn); returns each entry's offset in its rank's buffer,
        shaped like ``sizes``. One gather into the cached rank order and one cumsum, no sort: local
        rows (``k = 1``) and ring blocks (``k = 2``) alike."""
        order, rank = self.rank_order, self.stream_pieces.rank
        k = sizes.shape[1] if sizes.dim() == 2 else 1
        # entry e of piece p is flat entry k * p + e; in rank order the pieces' entries stay together
        flat_order = (order[:, None] * k + torch.arange(k)).reshape(-1) if k > 1 else order
        in_order = sizes.reshape(-1).index_select(0, flat_order)
        before = starts(in_order)
        totals = torch.zeros(self.world_size, dtype=torch.int64).index_add_(
            0, rank, sizes.reshape(-1, k).sum(1) if k > 1 else sizes.reshape(-1))
        first = starts(totals).index_select(0, rank)  # per piece, stream order
        offsets = torch.empty_like(before).scatter_(0, flat_order, before)
        if k == 1:  # (a 2-D broadcast subtraction costs 3x a flat one)
            return offsets.sub_(first).view(sizes.shape)
        return (offsets.view(-1, k) - first[:, None]).reshape(sizes.shape)

    @cached_property
    def rank_bounds(self) -> list[int]:
        """Where each rank's run of :attr:`rank_order` starts (and, last, its length)."""
        counts = torch.bincount(self.stream_pieces.rank, minlength=self.world_size)
        return [0, *torch.cumsum(counts, 0).tolist()]

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """Ordered ``(doc, start, end)`` pieces of ``rank``."""
        p = self.rank_pieces(rank)
        return list(zip(p.doc.tolist(), p.start.tolist(), p.end.tolist(), strict=True))

    def indices(self, rank: int) -> torch.Tensor:
        """Global stream index of each local token of ``rank``, in local order (int64)."""
        p = self.rank_pieces(rank)
        return expand(take(self.layout.cu_seqlens, p.doc) + p.start, p.length)

    def positions(self, rank: int) -> torch.Tensor:
        """Document-relative position of each local token (for RoPE), int64."""
        p = self.rank_pieces(rank)
        return expand(p.start, p.length)

    def doc_ids(self, rank: int) -> torch.Tensor:
        p = self.rank_pieces(rank)
        return repeat(p.doc, p.length)

    @cached_property
    def local_sizes(self) -> list[int]:
        """Number of local tokens on each rank."""
        p = self.stream_pieces
        return torch.zeros(self.world_size, dtype=torch.int64).index_add_(0, p.rank, p.length).tolist()

    def local_offsets(self, rank: int) -> Pieces:
        """Pieces of ``rank`` with ``start`` replaced by the local row of the piece's first token
        (as ``Pieces(rank, doc, row, doc_start)``)."""
        p = self.rank_pieces(rank)
        rows = starts(p.length)
        return Pieces(p.rank, p.doc, rows, p.start)

    @cached_property
    def work(self) -> list[int]:
        """Mask pairs each rank's queries attend (the work the strategies balance)."""
        p = self.stream_pieces
        pairs = self.mask.row_work(p.start, p.end, take(self.layout.lengths, p.doc))
        return torch.zeros(self.world_size, dtype=torch.int64).index_add_(0, p.rank, pairs).tolist()

    # -- communication -------------------------------------------------------------------
    @cached_property
    def seen(self) -> Pieces:
        """Key intervals each rank's queries see, merged per (rank, doc), in rank order."""
        return visible_intervals(self.stream_pieces, self.layout.lengths, self.mask, order=self.rank_order)

    @cached_property
    def kv_received(self) -> list[int]:
        """KV tokens each rank receives under the minimal exchange: what its queries see that
        it does not hold (its own tokens are always seen: the mask keeps the diagonal)."""
        s = self.seen
        seen = torch.zeros(self.world_size, dtype=torch.int64).index_add_(0, s.rank, s.length)
        return (seen - torch.tensor(self.local_sizes, dtype=torch.int64)).tolist()

    @cached_property
    def exchange(self) -> Intervals:
        """The minimal KV exchange: ``(dst, src, doc, start, end)`` rows (see plan.exchange).
        Every (receiver, sender) pair: O(N x pieces) rows for head_tail; the schedules and
        :meth:`stats` never build it."""
        return kv_exchange(self.stream_pieces, self.seen, self.layout)

    # -- statistics ----------------------------------------------------------------------
    def stats(self) -> PlanStats:
        """Per-rank tokens, work (mask pairs), imbalance, pieces, KV to receive, tile work."""
        p, n = self.stream_pieces, self.world_size
        lengths = take(self.layout.lengths, p.doc)
        work = torch.tensor(self.work, dtype=torch.int64)
        tiles = torch.zeros(n, dtype=torch.int64).index_add_(0, p.rank, _tile_counts(p, lengths, self.mask))
        total = int(work.sum())
        mean = total / n
        tile_mean = float(tiles.sum()) / n
        return PlanStats(
            tokens=self.local_sizes,
            work=work.tolist(),
            pieces=torch.bincount(p.rank, minlength=n).tolist(),
            kv_recv=self.kv_received,
            tile_work=(tiles * TILE * TILE).tolist(),
            imbalance=float(work.max()) / mean if mean > 0 else 1.0,
            tile_imbalance=float(tiles.max()) / tile_mean if tile_mean > 0 else 1.0,
            total_work=total,
            num_tokens=self.layout.num_tokens,
        )

    def __repr__(self) -> str:
        return (f"Plan(strategy={self.strategy!r}, world_size={self.world_size}, mask={self.mask}, "
                f"{self.layout!r})")


def _tile_counts(p: Pieces, doc_len: torch.Tensor, mask: Mask) -> torch.Tensor:
    """128x128 tiles touched by each piece's queries against its document's keys (key tiles
    aligned to document position 0, query tiles to the piece start): a fragmentation proxy.
    One entry per query tile, taken :data:`TILE_BATCH` tiles at a time (a batch may end inside a
    piece): memory stays bounded however long the documents are."""
    n_tiles = (p.length + TILE - 1) // TILE
    ends = torch.cumsum(n_tiles, 0)
    starts = ends - n_tiles  # each piece's first tile, numbered over all pieces
    counts = torch.zeros(len(p), dtype=torch.int64)
    for t0 in range(0, int(ends[-1]) if len(p) else 0, TILE_BATCH):
        t1 = t0 + TILE_BATCH
        a, b = int(torch.searchsorted(ends, t0, right=True)), int(torch.searchsorted(starts, t1))
        first, last = starts[a:b].clamp(min=t0), ends[a:b].clamp(max=t1)
        piece = repeat(torch.arange(a, b), last - first)
        q0 = take(p.start, piece) + expand(first - starts[a:b], last - first) * TILE
        q1 = torch.minimum(q0 + TILE, take(p.end, piece))
        lo, hi = mask.visible_keys(q0, q1, take(doc_len, piece))
        counts.index_add_(0, piece, torch.where(hi > lo, (hi - 1) // TILE - lo // TILE + 1, torch.zeros_like(lo)))
    return counts
