"""Who holds which tokens: :func:`plan` turns a layout into a :class:`Plan` of pieces.

A plan lists, for each CP rank, ordered pieces ``(doc, start, end)``; the rank's local
tokens are its pieces concatenated. Everything else follows from the pieces: gather
indices, RoPE positions, per-rank work, and which remote KV each rank needs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from doccp.layout import DocLayout, expand_ranges, repeat_interleave
from doccp.masks import Mask
from doccp.plan.balanced import balanced
from doccp.plan.exchange import Intervals, kv_exchange
from doccp.plan.head_tail import head_tail
from doccp.plan.pieces import Pieces, cut_stream, even_sizes

__all__ = ["Plan", "PlanStats", "plan", "STRATEGIES", "Pieces", "Intervals"]

TILE = 128


def contiguous(layout: DocLayout, world_size: int, mask: Mask | None = None) -> Pieces:
    """The stream cut into ``world_size`` equal contiguous ranges (the unbalanced baseline)."""
    return cut_stream(layout.cu_seqlens, even_sizes(layout.num_tokens, world_size))


Strategy = Callable[[DocLayout, int, Mask], Pieces]
STRATEGIES: dict[str, Strategy] = {"contiguous": contiguous, "head_tail": head_tail, "balanced": balanced}


def plan(layout: DocLayout, world_size: int, mask: Mask | None = None,
         strategy: str = "balanced") -> Plan:
    """Assign every token of ``layout`` to one of ``world_size`` ranks.

    Strategies: ``"contiguous"`` (baseline), ``"head_tail"`` (every document in 2N chunks)
    and ``"balanced"`` (cost-aware, keeps short documents whole). All give equal token
    counts per rank (within one), zero padding, every token exactly once.
    """
    if not isinstance(layout, DocLayout):
        raise TypeError(f"layout must be a doccp.DocLayout, got {type(layout).__name__}; "
                        "build one with DocLayout.from_lengths / from_cu_seqlens")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    mask = Mask.causal() if mask is None else mask
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a doccp.Mask, got {type(mask).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    pieces = STRATEGIES[strategy](layout, world_size, mask).normalized()
    return Plan(layout, world_size, mask, strategy, pieces)


@dataclass(frozen=True)
class PlanStats:
    """Per-rank figures of a plan (lists indexed by rank) and their summaries."""

    tokens: list[int]
    work: list[int]
    pieces: list[int]
    kv_recv: list[int]
    tile_work: list[int]
    padding: int
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
        rows.append(f"imbalance (max/mean work) {self.imbalance:.4f}   padding {self.padding}   "
                    f"max KV received {self.max_kv_fraction:.1%} of an all-gather")
        return "\n".join(rows)


@dataclass(frozen=True, eq=False)
class Plan:
    """Pieces per rank for one layout (see :func:`plan`). Immutable; derived data is cached."""

    layout: DocLayout
    world_size: int
    mask: Mask
    strategy: str
    all_pieces: Pieces

    def __post_init__(self) -> None:
        counts = torch.bincount(self.all_pieces.rank, minlength=self.world_size)
        object.__setattr__(self, "_offsets", torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))

    # -- per rank ------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}) for this plan, got {rank}")

    def rank_pieces(self, rank: int) -> Pieces:
        self._check_rank(rank)
        a, b = int(self._offsets[rank]), int(self._offsets[rank + 1])
        return self.all_pieces.select(slice(a, b))

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """Ordered ``(doc, start, end)`` pieces of ``rank``."""
        p = self.rank_pieces(rank)
        return list(zip(p.doc.tolist(), p.start.tolist(), p.end.tolist(), strict=True))

    def indices(self, rank: int) -> torch.Tensor:
        """Global stream index of each local token of ``rank``, in local order (int64)."""
        self._check_rank(rank)
        return self._stream_order[self._token_offsets[rank]:self._token_offsets[rank + 1]].clone()

    @cached_property
    def _stream_order(self) -> torch.Tensor:
        """The indices of every rank, rank after rank: one pass over the stream for all ranks
        (callers usually want them all: unshard, the demo, every rank's loader)."""
        p = self.all_pieces
        return expand_ranges(self.layout.cu_seqlens[p.doc] + p.start, p.length)

    @cached_property
    def _token_offsets(self) -> list[int]:
        return list(itertools.accumulate(self.local_sizes, initial=0))

    def positions(self, rank: int) -> torch.Tensor:
        """Document-relative position of each local token (for RoPE), int64."""
        p = self.rank_pieces(rank)
        return expand_ranges(p.start, p.length)

    def doc_ids(self, rank: int) -> torch.Tensor:
        p = self.rank_pieces(rank)
        return repeat_interleave(p.doc, p.length)

    @cached_property
    def local_sizes(self) -> list[int]:
        """Number of local tokens on each rank."""
        return torch.zeros(self.world_size, dtype=torch.int64).index_add_(
            0, self.all_pieces.rank, self.all_pieces.length).tolist()

    # -- communication -------------------------------------------------------------------
    @cached_property
    def exchange(self) -> Intervals:
        """The minimal KV exchange: ``(dst, src, doc, start, end)`` rows (see plan.exchange)."""
        return kv_exchange(self.all_pieces, self.layout.lengths, self.mask)

    def local_offsets(self, rank: int) -> Pieces:
        """Pieces of ``rank`` with ``start`` replaced by the local row of the piece's first token
        (as ``Pieces(rank, doc, row, doc_start)``)."""
        p = self.rank_pieces(rank)
        rows = torch.cumsum(p.length, 0) - p.length
        return Pieces(p.rank, p.doc, rows, p.start)

    # -- statistics ----------------------------------------------------------------------
    def stats(self) -> PlanStats:
        """Per-rank tokens, work (mask pairs), imbalance, pieces, KV to receive, tile work."""
        p, n = self.all_pieces, self.world_size
        lengths = self.layout.lengths[p.doc]
        work = torch.zeros(n, dtype=torch.int64).index_add_(0, p.rank, self.mask.pairs(p.start, p.end, 0, lengths))
        tiles = torch.zeros(n, dtype=torch.int64).index_add_(0, p.rank, _tile_counts(p, lengths, self.mask))
        total = int(work.sum())
        mean = total / n
        tile_mean = float(tiles.sum()) / n
        return PlanStats(
            tokens=self.local_sizes,
            work=work.tolist(),
            pieces=torch.bincount(p.rank, minlength=n).tolist(),
            kv_recv=self.exchange.tokens_received(n).tolist(),
            tile_work=(tiles * TILE * TILE).tolist(),
            padding=sum(self.local_sizes) - self.layout.num_tokens,
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
    aligned to document position 0, query tiles to the piece start): a fragmentation proxy."""
    n_tiles = (p.length + TILE - 1) // TILE
    piece = repeat_interleave(torch.arange(len(p)), n_tiles)
    first = expand_ranges(torch.zeros(len(p), dtype=torch.int64), n_tiles)
    q0 = p.start[piece] + first * TILE
    q1 = torch.minimum(q0 + TILE, p.end[piece])
    lo, hi = mask.visible_keys(q0, q1, doc_len[piece])
    count = torch.where(hi > lo, (hi - 1) // TILE - lo // TILE + 1, torch.zeros_like(lo))
    return torch.zeros(len(p), dtype=torch.int64).index_add_(0, piece, count)
