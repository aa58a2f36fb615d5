"""``head_tail``: every document cut into 2N chunks, rank r holds chunks r and 2N-1-r.

For a causal mask the chunk pairs have equal work, so every document is balanced on its
own, for any length and with zero padding::

    document of 18 tokens, N = 2 (chunks of 5, 4, 5, 4 after spreading the remainder)
    tokens  0....4  5...8  9...13  14..17
    chunk     0      1       2       3
    rank      0      1       1       0

Formula: with ``base = L // 2N`` and ``rem = L % 2N``, every chunk has ``base`` tokens and
the ``rem`` remainder tokens go one each to ranks ``(cursor + k) % N`` for ``k < rem``: to
the rank's head chunk while ``k < N``, to its tail chunk after. ``cursor`` is the number of
remainder tokens handed out by earlier documents (mod N), so remainders rotate across
documents and no rank collects one extra token per document.

The pieces are emitted in stream order and only the non-empty chunks are built: a document
shorter than 2N has ``L`` one-token chunks, not 2N, so the cost is O(pieces), never
O(documents x N). Chunks N - 1 and N (both rank N - 1's) are emitted as one piece, so the
pieces come out normalized and :func:`~doccp.plan.plan` has nothing to sort or merge. They are
built a batch of documents at a time (:func:`~doccp.ranges.batches`): at 16M tokens over 1024
ranks there are 14M pieces, and whole-table passes would page-fault every fresh table.
"""

from __future__ import annotations

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan.pieces import Pieces
from doccp.ranges import batches, expand, repeat, starts, take


def head_tail(layout: DocLayout, world_size: int, mask: Mask | None = None) -> Pieces:
    n, lengths = world_size, layout.lengths
    if lengths.numel() == 0 or layout.num_tokens == 0:
        return Pieces.empty()
    base, rem = lengths // (2 * n), lengths % (2 * n)
    cursor = starts(rem) % n
    # Non-empty chunks of each document, ascending: all 2N when base > 0; else the head chunks
    # of the ranks in the cyclic window [cursor, cursor + min(L, N)) and the tail chunks of the
    # window [cursor, cursor + L - N), each window as (wrapped part, unwrapped part).
    short = base == 0
    h = torch.where(short, torch.clamp(lengths, max=n), 0)
    m = torch.where(short, (lengths - n).clamp(min=0), 0)
    # Chunks N - 1 and N are both rank N - 1's and touch: one piece. Chunk N is left out of the
    # windows and its size added to chunk N - 1's, which is every such document's N-th piece (it
    # has all N head chunks, ascending).
    tail_first = torch.clamp(2 * n - torch.clamp(cursor + m, max=n), min=n + 1)
    firsts = torch.stack([torch.zeros_like(lengths), torch.where(short, cursor, n + 1), tail_first,
                          3 * n - cursor - m], 1)
    counts = torch.stack([
        torch.where(short, (cursor + h - n).clamp(min=0), n),
        torch.where(short, torch.clamp(cursor + h, max=n) - cursor, n - 1),
        torch.where(short & (m > 0), 2 * n - cursor - tail_first, 0).clamp(min=0),
        torch.where(short, cursor + m - n, 0).clamp(min=0),
    ], 1)
    pieces = counts.sum(1)
    middle = base + (((n - 1 - cursor) % n + n) < rem)  # chunk N's size (its order: rank N - 1's + N)
    per_doc = firsts, counts, pieces, base, rem, cursor, middle
    out = Pieces(*(torch.empty(int(pieces.sum()), dtype=torch.int64) for _ in range(4)))
    for d0, d1, e0, e1 in batches(pieces):  # (the per-piece tables stay in cache)
        _chunks(n, layout.cu_seqlens, d0, *(x[d0:d1] for x in per_doc), out=out.select(slice(e0, e1)))
    return out


def _chunks(n: int, cu: torch.Tensor, d0: int, firsts, counts, pieces, base, rem, cursor, middle, out: Pieces
            ) -> None:
    """Write the pieces of documents ``d0, d0 + 1, ...`` into ``out`` (views of the plan's columns;
    the per-document tables sliced to those documents)."""
    chunk = expand(firsts.reshape(-1), counts.reshape(-1))
    doc = repeat(torch.arange(pieces.numel()), pieces)
    rank = torch.minimum(chunk, (2 * n - 1) - chunk, out=out.rank)
    # the order in which the chunk gets a remainder token: (rank - cursor) mod N, plus N for a tail
    order = rank - take(cursor, doc)
    order += torch.where(order < 0, n, 0) + torch.where(chunk >= n, n, 0)
    size = take(base, doc) + (order < take(rem, doc))
    has = torch.nonzero(middle).squeeze(1)
    size.index_add_(0, take(starts(pieces), has) + (n - 1), take(middle, has))
    doc = torch.add(doc, d0, out=out.doc)
    end = torch.cumsum(size, 0, out=out.end).add_(int(cu[d0])).sub_(take(cu, doc))  # the pieces tile the stream
    torch.sub(end, size, out=out.start)
