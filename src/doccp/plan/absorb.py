"""Fallback of ``balanced`` for layouts it cannot otherwise balance: fix every rank exactly.

When one document is much longer than a rank, packing whole documents and contiguous parts
cannot equalise work. Then the largest document, the *absorber* (or the 2, 4, 8 largest when
one cannot reach a max/mean work of 1.004), is spread over every rank as a head piece and a
tail piece sized to hit each rank's exact token count and the mean work::

    1. split     docs too big to keep whole      ->  head-tail over all ranks (equal shares)
    2. pack      the rest, largest work first    ->  whole, onto the least-loaded rank
                                                     with token room
    3. spill     docs that fit nowhere whole     ->  cut over the ranks' remaining room
    4. absorb    the largest doc(s)              ->  each rank takes a head piece and a
                                                     tail piece sized to hit the exact
                                                     token count and the mean work

    absorber of 16 tokens (causal: position i costs i + 1 pairs); the ranks still need
    (tokens, work) = (6, 40), (5, 60), (5, 36):
    position  0 1 2 3 4 5 6 7 8 9 A B C D E F
    rank      1 0 0 0 2 2 2 2 2 0 0 0 1 1 1 1      ->  work 42, 59, 35

Ranks are served most-extreme-need first, choosing the head/tail split whose work is
closest to the need; the most typical rank takes what is left in the middle. Every rank then
receives most of the absorber, which is why ``balanced`` tries its cheaper plans first.
"""

from __future__ import annotations

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan.head_tail import head_tail
from doccp.plan.pieces import Pieces, cut_stream, even_sizes

#: A document is split when it needs more than this share of one rank's tokens or work
#: (whole documents first; cutting more of them gives the packing finer grains).
SPLIT_SHARES = (1.0, 0.5)


def absorb(layout: DocLayout, world_size: int, mask: Mask, work: torch.Tensor) -> Pieces:
    """The plan described in the module docstring; ``work`` is every document's pair count."""
    n = world_size
    lengths = layout.lengths
    by_length = torch.argsort(lengths, descending=True, stable=True)
    best, best_spread = None, float("inf")
    for share in SPLIT_SHARES:
        for count in ABSORBERS:
            pieces, loads = _balanced_with(layout, n, mask, work, by_length[:count], share)
            spread = float(loads.max()) / max(float(loads.double().mean()), 1.0)
            if spread < best_spread:
                best, best_spread = pieces, spread
            if spread <= GOOD_ENOUGH:
                return best
            if count >= layout.num_docs:
                break
    return best


#: How many absorbers to try, in order, until the work spread is GOOD_ENOUGH (max/mean).
ABSORBERS = (1, 2, 4, 8)
GOOD_ENOUGH = 1.004


def _balanced_with(layout: DocLayout, n: int, mask: Mask, work: torch.Tensor,
                   absorbers: torch.Tensor, share: float) -> tuple[Pieces, torch.Tensor]:
    lengths = layout.lengths
    target_tokens = even_sizes(layout.num_tokens, n)
    target_work = float(work.sum()) / n
    capacity = layout.num_tokens / n

    is_split = (lengths > share * capacity) | (work.double() > share * target_work)
    is_split[absorbers] = False
    split_docs = torch.nonzero(is_split).flatten()
    sub = head_tail(DocLayout.from_lengths(lengths[split_docs]), n)
    split_pieces = Pieces(sub.rank, split_docs[sub.doc], sub.start, sub.end)
    tokens = torch.zeros(n, dtype=torch.int64).index_add_(0, split_pieces.rank, split_pieces.length)
    loads = torch.zeros(n, dtype=torch.int64).index_add_(
        0, split_pieces.rank, _piece_work(split_pieces, lengths, mask))

    # Reserve each rank a share of every absorber, so every rank can still be corrected; if
    # that leaves a document no room to stay whole, pack first and reserve what is left.
    available = (target_tokens - tokens).clamp(min=0)
    is_split[absorbers] = True  # not packed whole
    for pack_first in (False, True):
        reserves, room, load = [], available.tolist(), loads.tolist()
        if pack_first:
            placed, spill = _pack_whole(lengths, work, is_split, room, load, target_work, capacity)
        left = torch.tensor(room)
        for doc in absorbers.tolist():
            reserves.append(_apportion(int(lengths[doc]), left))
            left = left - reserves[-1]
        if not pack_first:
            room = left.tolist()
            placed, spill = _pack_whole(lengths, work, is_split, room, load, target_work, capacity)
            if not spill:
                break
        else:
            room = left.tolist()
    whole_docs = torch.tensor([d for d, _ in placed], dtype=torch.int64)
    whole_pieces = Pieces.of(torch.tensor([r for _, r in placed], dtype=torch.int64),
                             whole_docs, 0, lengths[whole_docs])
    spill_pieces = _spill(layout, torch.tensor(spill, dtype=torch.int64), torch.tensor(room))
    loads = torch.tensor(load, dtype=torch.int64).index_add_(
        0, spill_pieces.rank, _piece_work(spill_pieces, lengths, mask))

    # Absorbers, largest first: each aims at the remaining need minus what the later ones
    # will contribute at their mean cost per token.
    mean_cost = [float(work[d]) / max(int(lengths[d]), 1) for d in absorbers.tolist()]
    parts = []
    for i, doc in enumerate(absorbers.tolist()):
        later = sum((reserves[j].double() * mean_cost[j] for j in range(i + 1, len(reserves))),
                    torch.zeros(n, dtype=torch.float64))
        piece = _absorb(doc, int(lengths[doc]), reserves[i], target_work - loads.double() - later, mask)
        loads = loads.index_add_(0, piece.rank, _piece_work(piece, lengths, mask))
        parts.append(piece)
    return Pieces.cat([split_pieces, whole_pieces, spill_pieces, *parts]), loads


def _piece_work(p: Pieces, lengths: torch.Tensor, mask: Mask) -> torch.Tensor:
    return mask.pairs(p.start, p.end, 0, lengths[p.doc])


def _apportion(total: int, weights: torch.Tensor) -> torch.Tensor:
    """Split ``total`` into integers proportional to ``weights`` (largest remainders)."""
    if total == 0 or int(weights.sum()) == 0:
        return even_sizes(total, weights.numel())
    exact = weights.double() * total / float(weights.sum())
    share = exact.floor().long()
    short = total - int(share.sum())
    if short:
        share[torch.argsort(exact - share.double(), descending=True)[:short]] += 1
    return share


def _pack_whole(lengths, work, is_split, room, load, target_work, capacity):
    """Greedy: documents by decreasing work, each to the rank that is lightest in tokens and
    work together (normalised) among those with room for it; returns (doc, rank) pairs and
    the documents that fit nowhere."""
    n = len(room)
    docs = torch.nonzero(~is_split & (lengths > 0)).flatten()
    order = docs[torch.argsort(work[docs] * (1 << 20) + lengths[docs], descending=True, stable=True)]
    lens, works = lengths[order].tolist(), work[order].tolist()
    used = [0] * n
    tw, tc = max(target_work, 1.0), max(capacity, 1.0)
    placed, spill = [], []
    for doc, length, w in zip(order.tolist(), lens, works, strict=True):
        best, best_score = -1, 0.0
        for r in range(n):
            if room[r] - used[r] >= length:
                score = load[r] / tw + used[r] / tc
                if best < 0 or score < best_score:
                    best, best_score = r, score
        if best < 0:
            spill.append(doc)
            continue
        used[best] += length
        load[best] += w
        placed.append((doc, best))
    for r in range(n):
        room[r] -= used[r]
    return placed, spill


def _spill(layout: DocLayout, docs: torch.Tensor, room: torch.Tensor) -> Pieces:
    """Cut the documents that fit nowhere whole over the ranks' remaining room, in order."""
    if docs.numel() == 0:
        return Pieces.empty()
    lengths = layout.lengths[docs]
    sub = cut_stream(torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]), room)
    return Pieces(sub.rank, docs[sub.doc], sub.start, sub.end)


def _absorb(doc: int, length: int, tokens: torch.Tensor, need: torch.Tensor, mask: Mask) -> Pieces:
    """Give rank r ``tokens[r]`` tokens of the absorber, a head piece and a tail piece, with
    work as close to ``need[r]`` as the document allows."""
    if length == 0:
        return Pieces.empty()
    active = [r for r in range(tokens.numel()) if int(tokens[r]) > 0]
    ratio = {r: float(need[r]) / int(tokens[r]) for r in active}
    mean = sum(ratio.values()) / len(ratio)
    order = sorted(active, key=lambda r: abs(ratio[r] - mean), reverse=True)
    lo, hi = 0, length
    ranks, starts, ends = [], [], []
    for i, r in enumerate(order):
        count = int(tokens[r])
        if i == len(order) - 1:
            head = hi - lo  # the most typical rank takes the middle
        else:
            h = torch.arange(count + 1)
            got = mask.pairs(lo, lo + h, 0, length) + mask.pairs(hi - (count - h), hi, 0, length)
            head = int(torch.argmin((got.double() - float(need[r])).abs()))
        tail = count - head
        ranks += [r, r]
        starts += [lo, hi - tail]
        ends += [lo + head, hi]
        lo, hi = lo + head, hi - tail
    return Pieces.of(torch.tensor(ranks), doc, torch.tensor(starts), torch.tensor(ends))
