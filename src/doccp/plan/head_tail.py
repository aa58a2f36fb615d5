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
"""

from __future__ import annotations

import torch

from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan.pieces import Pieces


def head_tail(layout: DocLayout, world_size: int, mask: Mask | None = None) -> Pieces:
    return head_tail_docs(layout.lengths, torch.arange(layout.num_docs), world_size, cursor=0)[0]


def head_tail_docs(lengths: torch.Tensor, docs: torch.Tensor, n: int, cursor: int) -> tuple[Pieces, int]:
    """Head-tail pieces for documents ``docs`` of ``lengths``; returns the cursor after them."""
    lengths = lengths[docs]
    d = docs.numel()
    if d == 0:
        return Pieces.empty(), cursor
    base, rem = lengths // (2 * n), lengths % (2 * n)
    starts = (cursor + torch.cumsum(rem, 0) - rem) % n  # cursor of each document
    ranks = torch.arange(n)
    slot = (ranks[None, :] - starts[:, None]) % n  # k of the rank's first extra token
    head = base[:, None] + (slot < rem[:, None]).long()
    tail = base[:, None] + (slot + n < rem[:, None]).long()
    sizes = torch.cat([head, tail.flip(1)], 1)  # chunk c: head of rank c, tail of rank 2N-1-c
    ends = torch.cumsum(sizes, 1)
    # Emitted rank by rank, then document, head before tail: the order a plan keeps them in.
    chunks = torch.stack([ranks, 2 * n - 1 - ranks], 1)  # [N, 2]: each rank's head and tail chunk
    pieces = Pieces(
        ranks[:, None, None].expand(n, d, 2).reshape(-1),
        docs[None, :, None].expand(n, d, 2).reshape(-1),
        (ends - sizes)[:, chunks].transpose(0, 1).reshape(-1),
        ends[:, chunks].transpose(0, 1).reshape(-1),
    )
    return pieces, int((cursor + rem.sum()) % n)
