"""Polish a balanced causal plan: trade rows of cut documents between two ranks to lower the max KV.

A plan's cut documents have *boundaries*, where one rank's piece ends and another rank's begins.
Moving a boundary by ``d`` tokens hands ``d`` rows of that document from one rank to the other;
moving a second boundary between the same two ranks by ``d`` the other way hands as many back, so
both keep their token counts. Nothing new is cut (a piece may vanish, and its document end up
whole). Under a causal mask a rank receives, per document it holds part of, the keys below its
highest row there that it does not hold; so such a *move* changes the KV and the work of those two
ranks only, in at most two documents::

    a document A of 100 tokens and one B of 60 over 2 ranks (80 tokens each, mean work 3440)
    before:  rank 0  A[0, 16) A[66, 100) B[0, 30)    receives A[16, 66): 50
             rank 1  A[16, 66) B[30, 60)             receives A[0, 16) and B[0, 30): 46
    after:   rank 0  A[0, 32) A[66, 100) B[0, 14)    receives A[32, 66): 34
             rank 1  A[32, 66) B[14, 60)             receives A[0, 32) and B[0, 14): 46
    A's first boundary moved up 16 rows and B's down 16: rank 0 took A's rows 16-31 (work 392) for
    B's rows 14-29 (360), its work 3472 within the cap (1.01 x 3440); the max KV 50 -> 46.

A rank may also give the other a whole document instead of rows at a second boundary: lengths
2, 13, 8, 3, 8 and 1 over 3 ranks, rank 1 receives 5 keys of the 13-token document and 3 of an
8-token one whose first 3 rows rank 2 holds; it gives rank 2 its 3-token document for those rows
(6 pairs each way) and receives 5, as the other ranks do.

The planner sizes its cuts for work first and snaps them to document boundaries; the freedom
that leaves (which rows of similar cost go where) is what a move uses. Each round takes the best
move of the rank that receives the most: for every pair of its boundaries shared with one other
rank, and either direction, the shift that evens the two ranks' KV out (a bisection: one rank's
KV falls and the other's rises with the shift), the largest the work cap allows and the whole
piece; for each of its boundaries, its whole documents nearest in length to what evens the KV out
and the longest that fits. The round's best lowers the max KV (or the number of ranks at it) or
the search ends, after :data:`ROUNDS` rounds or :data:`EVALUATIONS` moves scored. On the seeded layouts of 131k
tokens over 2-64 ranks it lowers the KV of 151 of 240 plans, 42 of them by 1% or more (which the
planner keeps: :data:`doccp.plan.balanced.POLISH_GAIN`), most where a few long documents are cut
(long mix #1 over 4 ranks: 0.611 -> 0.565 of an all-gather, the lower bound 0.556), in
milliseconds of host work (each move scored reads its two ranks' pieces of its documents).
"""

from __future__ import annotations

import bisect

import torch

from doccp.plan.pieces import Pieces
from doccp.ranges import any_true, stable_order, take

#: Most moves per polish, and most moves scored (each O(its two ranks' pieces of one or two documents);
#: a round scores about 20 per pair of the top rank's boundaries, and the round that spends the budget
#: applies its best move yet). On the benchmark's layouts (131k tokens, 4 mixes, 2-16 ranks), 64
#: rounds and 8x the moves scored lowered no mean KV by more than 0.0003 of an all-gather.
ROUNDS = 16
EVALUATIONS = 1024

Parts = list[list[int]]  # one document's pieces as [rank, start, end], in stream order


def polish(pieces: Pieces, n: int, cap: float) -> Pieces:
    """``pieces`` (a plan under a causal mask, in stream order, normalized) with moves applied while
    they lower (max KV, ranks at it); no rank's work exceeds ``cap`` (or its own, if higher). Only
    the cut documents' pieces become Python lists (the whole ones stay tensors: a million tokens
    hold thousands), and each rank's whole documents are listed when it first moves one."""
    doc = pieces.doc
    cut = torch.zeros(len(pieces), dtype=torch.bool)  # pieces of documents of more than one piece
    if len(pieces) > 1:
        same = doc[1:] == doc[:-1]
        cut[1:] |= same
        cut[:-1] |= same
    if not any_true(cut):
        return pieces
    work = torch.zeros(n, dtype=torch.int64).index_add_(0, pieces.rank, _pairs(pieces.start, pieces.end)).tolist()
    at = torch.nonzero(cut).squeeze(1)
    docs: dict[int, Parts] = {}
    for r, d, a, b in zip(*(take(c, at).tolist() for c in (pieces.rank, doc, pieces.start, pieces.end)), strict=True):
        docs.setdefault(d, []).append([r, a, b])
    kv = [0] * n
    for parts in docs.values():
        for r, v in _received(parts).items():
            kv[r] += v
    whole = pieces.select(~cut)
    search = _Search(docs, kv, work, max(cap, max(work)), whole)
    moves = 0
    while moves < ROUNDS and search.scored < EVALUATIONS and search.step():
        moves += 1
    if not moves:
        return pieces
    if search.given:  # whole documents another rank took
        moved = torch.tensor(list(search.given), dtype=torch.int64)
        rank = whole.rank.clone().index_copy_(0, torch.searchsorted(whole.doc, moved),
                                              torch.tensor(list(search.given.values()), dtype=torch.int64))
        whole = Pieces(rank, whole.doc, whole.start, whole.end)
    rows = [(p[0], d, p[1], p[2]) for d, parts in search.docs.items() for p in parts]
    out = Pieces.cat([whole, Pieces.of(*zip(*rows, strict=True))])
    return out.select(stable_order(out.doc))  # stream order (a document's pieces stay in order)


class _Search:
    """The cut documents' pieces, every rank's KV and work, and the greedy rounds over them."""

    def __init__(self, docs: dict[int, Parts], kv: list[int], work: list[int], cap: float, whole: Pieces):
        self.docs, self.kv, self.work, self.cap, self.whole = docs, kv, work, cap, whole
        self._wholes: dict[int, list[tuple[int, int]]] = {}
        self.given: dict[int, int] = {}  # whole documents moved: their new rank
        self._received: dict[int, dict[int, int]] = {}
        self._pieces_of: dict[int, dict[int, list[int]]] = {}
        self.scored = 0  # moves scored so far

    def step(self) -> bool:
        """Apply the best move of the rank that receives the most; False when none helps."""
        kv = self.kv
        top = max(range(len(kv)), key=kv.__getitem__)
        # top's boundaries: (document, index of the piece before it, the rank on the other side)
        ends = [(d, i, parts[i + 1][0] if parts[i][0] == top else parts[i][0])
                for d, parts in self.docs.items() for i in range(len(parts) - 1)
                if top in (parts[i][0], parts[i + 1][0])]
        moves = [(other, m) for x, (d1, i1, other) in enumerate(ends) for d2, i2, partner in ends[x + 1:]
                 if partner == other for sign in (1, -1) for m in self._moves(top, other, (d1, i1), (d2, i2), sign)]
        moves += [(other, m) for d, i, other in ends for m in self._swaps(top, other, d, i)]
        best, best_key = None, (kv[top], kv.count(kv[top]), 0)
        for other, move in moves:
            # the max KV and how many ranks receive it, then the busier rank's work (least first)
            rest = [v for r, v in enumerate(kv) if r not in (top, other)]
            high = max(*rest, *move.kv.values()) if rest else max(move.kv.values())
            key = (high, rest.count(high) + sum(v == high for v in move.kv.values()), max(move.work.values()))
            if key[:2] < best_key[:2] or (best is not None and key < best_key):
                best, best_key = move, key
        if best is None:
            return False
        self.apply(best)
        return True

    def _swaps(self, top: int, other: int, d: int, i: int) -> list[_Move]:
        """Moves that give ``other`` a whole document of ``top`` and ``top`` as many rows at
        boundary ``i`` of ``d``: the documents nearest in length to what evens the two ranks' KV
        out, and the longest that fits."""
        if self.scored >= EVALUATIONS:
            return []
        parts = self.docs[d]
        sign = 1 if parts[i][0] == top else -1  # the boundary moves into other's piece
        room = _room(parts, i, sign)
        held = self.wholes(top)
        k = bisect.bisect_right(held, (room, 1 << 62))
        want = bisect.bisect_left(held, ((self.kv[top] - self.kv[other]) // 2, -1), 0, k)
        moves = []
        for j in sorted({want - 1, want, k - 1} & set(range(k))):
            length, whole = held[j]
            if length == 0:
                continue
            move = self._moved(top, other, ((d, i, sign * length),), given=(whole, length, j))
            if move is not None:
                moves.append(move)
        return moves

    def _moves(self, top: int, other: int, first: tuple[int, int], second: tuple[int, int], sign: int
               ) -> list[_Move]:
        """The moves at boundaries ``first`` and ``second`` that take ``top`` rows at the first one
        (``sign`` 1: the first boundary moves up, else down) and give as many back at the second:
        by the shift that evens the two ranks' KV out within the work cap, the largest shift within
        it, and the whole piece."""
        if self.scored >= EVALUATIONS:
            return []
        (d1, i1), (d2, i2) = first, second
        p1, p2 = self.docs[d1], self.docs[d2]
        gain = sign if p1[i1][0] == top else -sign  # rows top gains at the first boundary per token
        sign2 = -gain if p2[i2][0] == top else gain
        room = min(_room(p1, i1, sign), _room(p2, i2, sign2))

        def at(shift: int) -> _Move | None:
            return self._moved(top, other, ((d1, i1, sign * shift), (d2, i2, sign2 * shift)))

        # The largest shift within the cap (the work changes monotonically with the shift but for
        # rows of mixed cost: a bisection, and whatever shift it ends at is checked like any other)
        lo, hi = 0, room
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if at(mid) is not None else (lo, mid - 1)
        shifts = {lo, room}
        # and where the two ranks' KV cross below it (top's falls with the shift, other's rises).
        a, b = 0, lo
        while b - a > 1:
            mid = (a + b) // 2
            move = at(mid)
            a, b = (a, mid) if move is None or move.kv[top] <= move.kv[other] else (mid, b)
        shifts |= {a, b}
        return [move for move in (at(shift) for shift in sorted(shifts - {0})) if move is not None]

    def _moved(self, top: int, other: int, shifts, given: tuple[int, int, int] | None = None) -> _Move | None:
        """The move of ``(document, boundary, shift)`` shifts, or None if boundaries cross or a
        rank's work would exceed the cap. O(the two ranks' pieces of its documents), nothing copied:
        the rows a boundary hands over change two ranks' work by their pairs, and the two ranks' KV
        in a document is one pass over their pieces with the shifted ends read in place."""
        self.scored += 1
        moved: dict[int, dict[int, int]] = {}  # document -> boundary -> shift
        work = {top: self.work[top], other: self.work[other]}
        for d, i, shift in shifts:
            moved.setdefault(d, {})[i] = moved.get(d, {}).get(i, 0) + shift
            parts = self.docs[d]
            end = parts[i][2]
            rows = _pairs(end, end + shift) if shift > 0 else -_pairs(end + shift, end)
            work[parts[i][0]] += rows  # the piece before the boundary grows by `shift` rows
            work[parts[i + 1][0]] -= rows
        if given is not None:  # a whole document of `top` goes to `other`
            whole = _pairs(0, given[1])
            work[top] -= whole
            work[other] += whole
        if max(work.values()) > self.cap:
            return None
        kv = dict.fromkeys((top, other), 0)
        for d, at in moved.items():
            seen = _received_shifted(self.docs[d], at, (top, other), self.pieces_of(d))
            if seen is None:
                return None
            for r in kv:
                kv[r] += seen[r] - self.received(d).get(r, 0)
        return _Move(moved, {r: self.kv[r] + v for r, v in kv.items()}, work, given and (top, other, given))

    def wholes(self, r: int) -> list[tuple[int, int]]:
        """Rank ``r``'s whole documents as ``(length, document)``, shortest first (listed once)."""
        if r not in self._wholes:
            mine = self.whole.select(self.whole.rank == r)
            self._wholes[r] = sorted(zip(mine.end.tolist(), mine.doc.tolist(), strict=True))
        return self._wholes[r]

    def received(self, d: int) -> dict[int, int]:
        """:func:`_received` of document ``d``, cached until a move changes it."""
        if d not in self._received:
            self._received[d] = _received(self.docs[d])
        return self._received[d]

    def pieces_of(self, d: int) -> dict[int, list[int]]:
        """Document ``d``'s pieces of each rank (their indices), cached until a move changes it."""
        if d not in self._pieces_of:
            held: dict[int, list[int]] = {}
            for i, (r, _, _) in enumerate(self.docs[d]):
                held.setdefault(r, []).append(i)
            self._pieces_of[d] = held
        return self._pieces_of[d]

    def apply(self, move: _Move) -> None:
        for d, at in move.shifts.items():
            parts = [p[:] for p in self.docs[d]]
            for i, shift in at.items():
                parts[i][2] += shift
                parts[i + 1][1] += shift
            self.docs[d] = _merged(parts)
            self._received.pop(d, None)
            self._pieces_of.pop(d, None)
        for r, v in move.kv.items():
            self.kv[r] = v
        for r, v in move.work.items():
            self.work[r] = v
        if move.given is not None:
            top, other, (whole, length, j) = move.given
            del self.wholes(top)[j]
            bisect.insort(self.wholes(other), (length, whole))
            self.given[whole] = other


class _Move:
    """A move: per document, the shift of each boundary it moves; the new KV and work of its two
    ranks."""

    def __init__(self, shifts: dict[int, dict[int, int]], kv: dict[int, int], work: dict[int, int],
                 given: tuple | None = None):
        self.shifts, self.kv, self.work, self.given = shifts, kv, work, given


def _pairs(a: int, b: int) -> int:
    """Causal pairs of rows ``[a, b)``: row ``i`` sees its ``i + 1`` first keys."""
    return (b * (b + 1) - a * (a + 1)) >> 1


def _received(parts: Parts) -> dict[int, int]:
    """KV each rank receives of one document: its highest row's keys it does not hold."""
    top: dict[int, int] = {}
    own: dict[int, int] = {}
    for r, a, b in parts:
        top[r] = max(top.get(r, 0), b)
        own[r] = own.get(r, 0) + b - a
    return {r: top[r] - own[r] for r in top}


def _received_shifted(parts: Parts, shifts: dict[int, int], ranks: tuple[int, int],
                      pieces_of: dict[int, list[int]]) -> dict[int, int] | None:
    """:func:`_received` of ``ranks`` in a document whose boundaries ``i`` moved by ``shifts[i]``
    (the end of piece i and the start of piece i + 1), or None where a piece would end before it
    starts. ``pieces_of``: the document's pieces of each rank (only those of ``ranks`` are read,
    and only the pieces next to a moved boundary can turn empty: O(their pieces), not the
    document's, which a long one cut over 64 ranks has 127 of)."""
    for i, shift in shifts.items():
        if (parts[i][2] + shift < parts[i][1] + shifts.get(i - 1, 0)
                or parts[i + 1][2] + shifts.get(i + 1, 0) < parts[i + 1][1] + shift):
            return None
    out = {}
    for r in ranks:
        top = own = 0
        for i in pieces_of.get(r, ()):
            _, a, b = parts[i]
            a, b = a + shifts.get(i - 1, 0), b + shifts.get(i, 0)
            if b > a:
                top = max(top, b)
                own += b - a
        out[r] = top - own
    return out


def _room(parts: Parts, i: int, sign: int) -> int:
    """How far boundary ``i`` (between pieces i and i + 1) may move up (``sign`` 1) or down."""
    piece = parts[i + 1] if sign > 0 else parts[i]
    return piece[2] - piece[1]


def _merged(parts: Parts) -> Parts:
    """Empty pieces dropped, touching pieces of one rank merged."""
    out: Parts = []
    for p in parts:
        if p[2] <= p[1]:
            continue
        if out and out[-1][0] == p[0] and out[-1][2] == p[1]:
            out[-1][2] = p[2]
        else:
            out.append(p)
    return out
