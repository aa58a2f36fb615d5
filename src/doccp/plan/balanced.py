"""``balanced``: equal tokens and work per rank, little KV to exchange, short documents whole.

Every rank must end with the same number of tokens (within one) *and* the same attention
work (mask pairs, max/mean <= 1.01). A rank receives KV only for documents it holds part of,
and for a causal mask a piece ``[a, b)`` needs exactly its prefix ``[0, a)``; so the plan cuts
few documents, each into contiguous runs over adjacent ranks.

The documents are laid out in one *sequence*, densest (work per token) first, each document
reversed (its expensive last tokens first). Rank r takes a run from the front of the sequence
and a run from the back, so the heavy documents at the front are shared out over consecutive
ranks while the light ones at the back fill the ranks up::

    sequence (densest first)   | D D D D D D D C C C B B A A |     (D reversed: tail first)
    rank 0: front run + back run       0 0 0            0 0
    rank 1: front run + back run             1 1 1    1
    rank 2: the middle                             2 2

Rank r's runs end at front cut ``x`` and back cut ``y``; the ranks 0..r hold ``x + (T - y)``
tokens and ``Wf(x) + W - Wf(y)`` work, where ``Wf`` is the work of a prefix of the sequence
(one binary search over the documents and one closed-form pair count). Both must be ``r + 1``
ranks' share, so ``y = x + T - K_r`` and ``x`` solves one scalar equation, independently for
every r: a vectorised bisection, O(N log T) host work after one sort of the documents. Each
cut then snaps to a document boundary where the work allows, moving the other cut by as many
tokens (documents that can stay whole stay whole), and the cuts are made monotone. (The held
work need not grow with ``x``: a big document's cheap head can be lighter than what follows it,
so a rank's root may lie behind the previous rank's cut. Such cuts are solved again, a run of
offenders at a time, in the window the previous cut leaves, or the previous rank moves to
another of its roots: 4096 tokens per rank of the lognormal mix then plan in 20-70 ms, where
the recursive bisection below had to step in at 4-5x that.)

A document too big for one rank is one unit of the sequence at first (its parts land on
adjacent ranks); it is also tried with its head moved to the back of the sequence, where the
KV is heavy (the ranks holding its tail hold its head too and receive only its middle: for one
document over two ranks the worse rank receives about 0.46 L instead of 0.71 L, close to the
optimum), and when neither balances, it is cut into chunks of a fraction of a rank that sort by
density on their own (its cheap head trails with the light documents). A cut document that
could have stayed whole is then *pinned* whole to one rank and the rest solved again. Of two
plans, the one cutting fewer such documents wins while it receives at most :data:`KV_SLACK` more
KV and at most :data:`KV_SLACK_TOKENS` more; beyond either, the least KV wins.

One sequence for all ranks pairs the documents at its front with those at its back on the same
ranks; where big documents fill groups of ranks, that puts one's tail and another's head on one
rank, which then receives most of both prefixes. So a recursive *bisection* is tried too
(:func:`_bisection_plan`): the ranks split into two groups, each with its own sequence, again
and again; the split (how many ranks, where the cuts fall) is chosen to cut the least KV, so a
big document goes to a group of ranks of its own. Front run + back run pairs the densest chunks
with the lightest; where a big document and the lightest ones make too little work (and the
next document's tail must fill in: a rank receives nearly all of its prefix), the bisection
also tries a *window* of the sequence in place of the back run, after the big document: its
position sets its work, so no big document is cut (with two ranks, that is the bisection).

With few ranks (at most :data:`PACK_RANKS`) a rank's share holds many documents, and whole ones
can balance it by themselves. A *packing* (:func:`_packings`) pins documents whole to ranks first,
heaviest first, each to the rank with the most work left to fill among those it fits (with up to
:data:`MATCH_RANKS` ranks, the most beyond what its tokens left hold at the reserve's work per
token, so that every rank is left what the reserve can fill), and holds back a reserve of the
lightest documents (a share of the tokens) for the sequence to share out:
it then cuts only short documents, for a few tokens of KV where the sequence alone cuts long
ones (pretrain mix, 2 ranks: 0.2% of an all-gather instead of 12%). Where a document is too big
to stay whole, packings are also tried with its head at the back of the sequence: every rank then
takes a run of its tail from the front and one of its head from the back, next to the whole
documents pinned to it (one document of 57% of the tokens over 4 ranks: 52% of an all-gather
received instead of 56%); and again with such documents *hosted* by as few ranks as their work
needs, which get that much less of the whole documents (else every rank takes a sliver of a big
document and the one holding its last sliver receives nearly all of it). Each reserve share is one
more plan, solved with the first probes and scored against the search's best at its end (it
never ends the search early: pinning passes may still find less KV). Where one document (or a
few) is too big to stay whole and the KV is still above the goal, its *nested* parts are tried
last (:mod:`doccp.plan.nested`: each rank a head and a tail of what the ranks outside it left, the
innermost the middle, sized so that no rank receives more than the least bound that fits; a few
such documents each on ranks of their own, or where they do not all fit, the heaviest one's alone),
pinned from rank 0 or, mirrored, from rank N - 1, with
the other documents shared out or packed around them (the same document: 49%); and for two of
them, nested from opposite ends, sharing the innermost rank (two documents of 54% and 45% of
the tokens over 4 ranks: 48% of an all-gather instead of 62%). Where nothing
balances (a few documents of a few tokens per rank can defeat every cut), the plan is
head_tail's, which balances each document on its own under a causal mask. With two ranks
under a causal mask, :mod:`doccp.plan.two_ranks` adds plans that cut one document, head and tail
on one rank and middle on the other, beside whole documents a local search picks (both a head
and the whole documents beside it are sized exactly, which the sequence's cuts cannot do). Last,
for up to 16 ranks, :mod:`doccp.plan.trims` packs whole documents by density and cuts a short run
off the heaviest ones where a rank cannot be filled around them, instead of cutting a dense
document at every rank boundary (sft mix #7, 8 ranks: 0.025 of an all-gather -> 0.0039). Under a
causal mask the best plans (:data:`POLISHED` of them) are then *polished* (:mod:`doccp.plan.polish`):
rows of their cut documents traded between pairs of ranks, where that lowers the max KV within the
work tolerance (kept where it saves :data:`POLISH_GAIN` of it at least; else within the busiest
rank's work, which costs no balance), and the best polished plan wins. Then, for up to 16 ranks,
every document too big to stay whole is nested on ranks of its own (sized for each of
:data:`NESTED_FILLS`) and the other documents are packed whole around the parts, the heaviest
trimmed (:func:`doccp.plan.trims.packings_around`): where the parts leave many uneven rooms, whole
documents fill them closer than the sequence's cuts (lognormal #5 over 16 ranks, three documents of
1.0-1.7 ranks' work among short ones: 4217 keys -> 2295); the best such plan is polished on its own
(among the leaders it would push out one that polishes lower). After them, for up to 16
ranks, :mod:`doccp.plan.hosts` hosts the heaviest documents whole on ranks of their own, filled with
the cheapest whole documents and an equal share of short heads from every other rank (lognormal #5
over 8 ranks, two documents of 85% of a rank's work: 450 keys -> 154).

The costlier candidates (head-at-back layouts, bisections) are tried only while the best plan
receives more than the (unbalanced) contiguous split's max KV plus :data:`KV_GOAL` of an
all-gather, or more than :data:`KV_HEAVY` of one (:data:`KV_BIG` in a big batch, :data:`KV_BIG_FEW`
over few ranks). Under a causal mask the search ends at the first balanced plan within
:data:`BOUND_SLACK` of a lower bound that the longest document sets
(:func:`doccp.plan.bound.causal_floor`: the rank holding its last row holds at most a rank's tokens
of it within the work cap), where no candidate to come could lower the KV by more: one document much
longer than a rank decides the KV (pareto mix #0, 4M tokens over 1024 ranks, a document of 1.1M
tokens: the first probe receives 1118615 keys, the floor is 1115099, and the search took 1.0 s for
1118657). Every
candidate plan is scored (unbalanced, max KV received, whole-able documents cut, spread) and
the best one kept (where none balances, the one nearest balance, to the tolerance, then the
least KV); a handful of candidates, each O(chunks log chunks + N log T) vectorised host
work (the bisection: O(log N) levels of it), no loop over documents or ranks (but the packings'
greedy, over a few hundred documents at most). Small layouts are bound by the per-call overhead of that work, not its
width, so every bisection variant is solved in one pass (each in rank
groups of its own) the first time one is tried, and so are the sequence plans the search is
about to try (each configuration a group of its own; plans solved together are scored together):
the first probes together and, where the search is likely to run long, each pinning pass in
lockstep (a round at a time for all its chains: a chain's round depends only on its own previous
one), replayed in the search's order.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import NamedTuple

import torch

from doccp.layout import DocLayout
from doccp.masks import BandMask, Mask
from doccp.plan.bound import causal_floor
from doccp.plan.exchange import visible_intervals
from doccp.plan.head_tail import head_tail
from doccp.plan.hosts import hosted_packings
from doccp.plan.nested import nested_parts, opposed_parts
from doccp.plan.pieces import Pieces, cut_stream, even_sizes
from doccp.plan.polish import polish
from doccp.plan.trims import packings_around, trimmed_packings
from doccp.plan.two_ranks import two_rank_plans
from doccp.ranges import expand, repeat

#: Work imbalance (max/mean) a plan must reach.
TOLERANCE = 1.01
#: Share of one rank's mean work a single cut may be off by after snapping (two cuts bound a
#: rank, so a rank is off by at most twice this plus one token's work).
SNAP_SLACK = 0.003
#: Work beyond its need (share of the mean) a rank may end with after snapping.
SNAP_BUDGET = 0.008
#: Plans solved before a balanced one that still cuts a document that could stay whole is taken:
#: when it cuts only a few (at most FEW_CUTS), the search goes on longer (a README-sized layout,
#: where each such document is a large share of a rank); with many, each costs little KV.
ATTEMPTS = 2
ATTEMPTS_FEW_CUTS = 16
FEW_CUTS = 2
#: Max KV a plan may give up to cut fewer documents that could stay whole: a share of its KV,
#: and at most this many tokens (a cut document costs a piece: a kernel fragment and a slice of
#: the exchange, worth a few hundred tokens of KV). The README-sized layout keeps its 300-token
#: document whole for 27 tokens (3%) more; at 131k tokens, 18 of 240 seeded layouts take plans
#: that save more (0.002-0.019 of an all-gather), 4 more than a cap of 0.02 of an all-gather.
KV_SLACK = 0.05
KV_SLACK_TOKENS = 256
#: The search ends at a balanced plan within this share of the causal floor of the longest document
#: (:func:`doccp.plan.bound.causal_floor`, a lower bound): one document much longer than a rank
#: decides the KV, and the costlier candidates could lower it by that share at most.
BOUND_SLACK = 0.01
#: Rounds of pinning cut documents that could stay whole to one rank and solving again.
PIN_ROUNDS = 3
#: Where a cut document that could stay whole is pinned, tried in turn: the rank holding most of
#: it, rank 0 (whose back run holds the lightest documents), the lowest of its ranks.
PIN_TO = ("most", "zero", "first")
#: Bisection steps :meth:`Sequence.solve` takes per evaluation of the held work: the midpoints of
#: every path through the next few steps in one vectorised call (up to SOLVE_POINTS of them), the
#: same roots in a quarter of the calls. Planning is bound by the per-call overhead of those calls
#: where few brackets are solved at once, not by their width.
SOLVE_LEVELS = 4
SOLVE_POINTS = 1024
#: Chunks on either side of a cut whose boundaries the cut may snap to.
SNAP_REACH = 2
#: Rounds of re-solving cuts that overtook their neighbour before clamping them (each settles the
#: first offender of every run: 4M tokens over 1024 ranks has runs of up to 9-16).
MONOTONE_ROUNDS = 16
#: Cuts a repair of :func:`_monotone` samples in its window before it bisects.
REPAIR_GRID = 32
#: Chunks per rank's tokens that a document too big to stay whole is cut into before sorting,
#: tried in turn: 0 keeps it one chunk (its parts land on adjacent ranks: least KV); finer
#: chunks sort the sequence closer to token cost (balance when big documents dominate). Those that
#: lay out the same sequence (small layouts) are tried once (:func:`_distinct_chunkings`), so the
#: search's attempts go to distinct plans.
CHUNKS_PER_RANK = (0, 4, 16, 64, 256, 1024)
#: The costlier candidates (head-at-back layouts, the bisection, nested parts) are tried only where
#: the best plan so far receives more than the contiguous split's max KV plus KV_GOAL of an
#: all-gather, or more than KV_HEAVY of one (each costs one or O(log N) more solves), or, in a big
#: batch, more than KV_BIG of one and KV_BIG_TOKENS tokens. A plan within the goal may still receive
#: much: trying them above 0.08 of an all-gather, not only above 0.25, lowered the KV on 34 of 240
#: layouts of 131k tokens (5 mixes, N 2-64; pretrain over 4 ranks, layout 5: 0.163 -> 0.092; mean
#: pretrain N = 8 0.185 -> 0.169, lognormal N = 64 worst 0.122 -> 0.099) and raised it on 2 (by at
#: most 0.009, for fewer documents cut), for about 12% more planning time there. In a small batch
#: the same KV share is few tokens, and the search took 2-4x as long (32k tokens over 8 ranks: a
#: median of 38 -> 140 ms), so the lower threshold waits for a few thousand tokens of KV.
KV_GOAL = 0.05
KV_HEAVY = 0.25
KV_BIG = 0.08
KV_BIG_TOKENS = 8192
#: KV_BIG and KV_BIG_TOKENS over at most PACK_RANKS ranks, where a rank holds many documents and the
#: candidates find more: above 0.05 and 4096 tokens, not 0.08 and 8192, 7 of 240 layouts of 131k
#: tokens (5 mixes x 8 layouts x N 2-8) receive less, up to 33% (pareto #2 over 6 ranks 0.075 ->
#: 0.050; pretrain #3 over 8 ranks 0.077 -> 0.061), 1 more by 5%, for fewer documents cut (pretrain
#: #2 over 6 ranks 6388 -> 6720 keys, 6 cut instead of 10); of 8k and 32k tokens, 3 of 240 less by
#: 4-7%, none more. Planning costs up to 18% more on the pareto and pretrain mixes at N 4-8, most of
#: it where they win (35 ms where they lose: pretrain #2 over 8 ranks 99 -> 133 ms). Beyond 8 ranks
#: fewer gain (3 of 200 layouts of 131k tokens at N 16-64, 3 more by under 4%) and the cost is high
#: (lognormal #0 over 64 ranks 14 -> 71 ms).
KV_BIG_FEW = 0.05
KV_BIG_FEW_TOKENS = 4096
#: Where the sequences of the plans solved together hold at most this many chunks (and few ranks),
#: the search solves ahead: the first probes in one pass, and a pinning pass in lockstep (every
#: chain's rounds, a round at a time for all chains) where it is likely to run long. Such layouts are
#: bound by the per-call overhead of the solves, not their width, so one pass of calls for all costs
#: little more than one chain's; the search replays the results in its own order (the same plans).
LOCKSTEP_CHUNKS = 1 << 18
#: Relative work error the bisection planner's group splits may take in all (a rank's work is
#: its group's share; what a split misses is spread over the group's ranks).
BISECT_BUDGET = 0.006
#: Most group splits (first ranks of the group) the bisection planner tries per group.
SPLIT_TRIES = 16
#: Head shares of documents that cannot stay whole the bisection planner tries in turn (see
#: HEAD_BACK; 0: each such document one chunk), each with whether the head goes to the back *late*:
#: only in groups about to split into single ranks, where a document then sits whole in a group
#: of two sized for it (early: the heads of every big document trail the first level's sequence,
#: and one group's back run takes another group's head). The share sets which receiver is worst (the
#: rank holding head and tail receives the middle, the last middle rank the prefix before it), and
#: the best one varies by layout, so several are tried, all in one pass (0.2 added to 0.25 and 0.4:
#: 54 of 900 small plans better by the scorer, 3 worse; 0.15 and 0.3 gained more KV but cut the
#: README example's 300-token document for 8-11% less KV).
BISECT_HEAD_BACK = ((0.0, False), (0.2, False), (0.25, False), (0.4, True))
#: Most ranks the late-head bisections are tried for (they gained KV only for N <= 4 on the
#: seeded mixes; each is a full bisection more).
LATE_HEAD_RANKS = 8
#: Whether the bisection planner's first ranks of a group take a window of the group's sequence
#: (after a big chunk's edge as the front cut) besides the back run, tried in turn (see
#: :func:`_bisection_plan`; with two ranks, only the windows: the back run is the sequence plan).
BISECT_WINDOW = (False, True)
#: Most ranks the window bisections are tried for: they help where a few big documents each fill
#: much of a rank (small N); beyond, they gained little KV on the seeded mixes for 2-3x the host time.
WINDOW_RANKS = 8
#: Brackets per candidate split in which the bisection planner looks for a cut pair.
BRACKETS = 8
#: Chunks per group whose edges the bisection planner tries as cuts (the biggest ones).
BIG_CHUNKS = 4
#: Shares of the tokens held back, as the lightest documents, when documents are packed whole onto
#: ranks first (tried in turn, see :func:`_packings`): the sequence then shares out only those.
PACK_RESERVE = (0.1, 0.2, 0.35, 0.5)
#: Most ranks the packings are tried for: with few ranks, a rank's share holds many documents and
#: whole ones can balance it (2-8 ranks: up to 20x less KV on average on the seeded mixes, up to
#: 1000x on a layout); beyond, the KV is that of the documents too big to stay whole, which packing
#: does not change (16 ranks: none less on any mix).
PACK_RANKS = 8
#: Most documents a packing pins (heaviest first; lighter ones join the reserve): its greedy takes
#: a few heap operations per document, so planning a million tokens stays in milliseconds.
PACK_DOCS = 512
#: Share of a document too big to stay whole that goes, as its *head*, to the very back of the
#: sequence (tried in turn): the ranks holding its tail then hold its head too and receive only
#: the middle (one document of 57% of the tokens over 2 ranks: 47% of an all-gather, not 79%).
HEAD_BACK = (0.2, 0.4)
#: The reserves also tried with the heads of documents too big to stay whole at the back of the
#: sequence (each :data:`HEAD_BACK` share): every rank then takes a run of such a document's tail
#: from the front and one of its head from the back, and whole documents fill it up (pareto mix,
#: 4 ranks, one document of 57% of the tokens: 0.555 -> 0.522 of an all-gather; pretrain, 4 ranks:
#: 0.494 -> 0.447). Two of the four: the other two found no better plan on the benchmark's layouts.
PACK_HEAD_RESERVE = (0.1, 0.35)
#: The reserves also tried (heads at the back, each :data:`HEAD_BACK` share) with the documents too
#: big to stay whole *hosted* by as few ranks as their work needs (the first ``ceil(work / share)``,
#: which the sequence gives them): those ranks get that much less of the whole documents, so no rank
#: takes a sliver of a big one and receives most of its prefix (135 layouts of 4 mixes with such
#: documents, N 2-8: 28 with less KV, up to 32%: pretrain #4 over 3 ranks 0.167 -> 0.113).
PACK_HOSTED_RESERVE = (0.1, 0.35)
#: Most ranks whose packings are *matched* to the reserve's work per token (see :func:`_packings`).
#: On 64 layouts of 4 mixes at N 2-4: less KV on 31, sft over 4 ranks worst 0.0068 -> 0.0004 of an
#: all-gather and mean 0.0011 -> 0.0002; 10 got a few tokens more (at most 13) and one 2% more
#: (pretrain #6 over 2 ranks, whose plan now cuts fewer short documents, within :data:`KV_SLACK`).
#: At 8 ranks it traded means between mixes (sft 0.0151 -> 0.0143, pareto 0.1749 -> 0.1757).
MATCH_RANKS = 4
#: Range of the sort key plans scored in one pass share (:func:`_scores`; below int64's).
SCORE_KEY_LIMIT = 1 << 62
#: Share of the work tolerance the nested parts of a document may take (the rest is room for the
#: documents that fill the ranks up, whose work per token is only estimated).
NESTED_CAP = 0.5
#: Fill densities (shares of the other documents' mean work per token) the nested parts are sized
#: for, each tried: the ranks that hold most of the document can be filled up with lighter
#: documents than the mean, and then hold more of it and receive less (103 layouts of 4 mixes
#: with one such document, N 2-8: 15 with less KV, up to 0.043 of an all-gather; pretrain #4 over
#: 4 ranks 0.148 -> 0.125).
NESTED_FILLS = (1.0, 0.6, 0.3)
#: Most documents too big to stay whole whose nested parts are pinned together, each on ranks of
#: its own (the heaviest from rank 0, each next one after the last rank of the one before).
NESTED_DOCS = 3
#: The nested parts are pinned from rank 0 outwards-in and also mirrored, from rank N - 1: a
#: sequence plan's first ranks take the costly last rows of the densest documents it cuts (and
#: receive their prefixes), and rank 0, the outermost holder of the parts, receives the most of
#: the big document already; mirrored, the two land on different ranks (64 layouts of 4 mixes at
#: N 2-8 with such a document: 8 with less KV, none more; pareto #5 over 3 ranks 0.112 -> 0.079).
NESTED_MIRRORED = (False, True)
#: With two ranks under a causal mask, the plans of :mod:`doccp.plan.two_ranks` are tried where the
#: best plan receives more than this share of an all-gather (below, few tokens to gain for up to
#: 100-250 ms of local search on 131k tokens).
TWO_RANKS_KV = 0.02
#: The trimmed packing's plans with heads cut off beforehand (:data:`doccp.plan.trims.HEADS`) are
#: tried where the best plan receives more than this share of an all-gather (below, a few hundred
#: keys to gain for 5-30 ms of packings on 131k tokens).
HEADS_KV = 0.01
#: Work cap (a share of the mean) of the ranks a polish trades rows between: the tolerance, less a
#: hair so that float rounding of max/mean never reads a polished plan as unbalanced.
POLISH_CAP = TOLERANCE - 1e-9
#: Least share of the max KV a polish within the tolerance must save to be kept: its moves spend the
#: tolerance (the polished plans' imbalance is near 1.01), worth it for a few % of KV, not for a few
#: tokens (131k tokens, 5 mixes, N 2-64: 151 of 240 plans polished lower, 42 by 1% or more, up to
#: 7.4%; 1M tokens over 64 ranks: 6074 -> 6044 keys for an imbalance of 1.0039 -> 1.0098). Below
#: it, the plan is polished again within its own busiest rank's work, which costs no balance.
POLISH_GAIN = 0.01
#: Best plans of the search kept and polished, each where its max KV less :data:`POLISH_REACH` of it
#: is below the best's (a plan further behind rarely polishes lower). Polishing the next two too, on
#: 320 layouts of 5 mixes at N 2-32: 24 with less KV, up to 64% (pretrain #0 over 4 ranks: 87 -> 31
#: keys; long #6 over 6 ranks: 56780 -> 47379), none with more, for 3% more host time (with a reach
#: of 0.2: 27 with less, one more by the scorer; six plans: 5 more with less, 7% more time).
POLISHED = 3
POLISH_REACH = 0.1


#: A candidate plan's score (:func:`_score`), compared by :func:`_better`.
Score = tuple[int, int, int, float]


class Chunking(NamedTuple):
    """How the sequence lays out documents too big to stay whole: ``per_rank`` chunks per rank's
    tokens sorted by density (0: one chunk), or, with ``head_back``, the document's tail by
    density and its first ``head_back`` share last; with ``bisect``, in the sequences of a
    recursive bisection of the ranks (:func:`_bisection_plan`) instead of one sequence, there
    with ``window``, a window of the sequence in place of the back run where it cuts less, and
    with ``late``, heads split off only in groups of two ranks. With ``reserve``, the documents
    are first packed whole onto ranks but for that share of the tokens (:func:`_packings`), with
    ``hosted``, leaving room on the ranks that take the documents too big to stay whole."""

    per_rank: int
    head_back: float = 0.0
    bisect: bool = False
    window: bool = False
    late: bool = False
    reserve: float = 0.0
    hosted: bool = False


def balanced(layout: DocLayout, world_size: int, mask: Mask) -> Pieces:
    """The plan of the module docstring. The search runs in inference mode: its thousands of
    small tensor ops dispatch with less overhead there (planning a small batch is bound by that
    overhead: 13-30% less time on 8k-32k tokens), and its plan is copied out as ordinary tensors,
    which autograd may save (an index of a sharded tensor, say)."""
    with torch.inference_mode():
        pieces = _search(layout, world_size, mask)
    return Pieces(*(column.clone() for column in (pieces.rank, pieces.doc, pieces.start, pieces.end)))


def _search(layout: DocLayout, world_size: int, mask: Mask) -> Pieces:
    n, lengths = world_size, layout.lengths
    if n == 1 or layout.num_tokens == 0:
        return Pieces.of(0, torch.arange(layout.num_docs), 0, lengths)
    doc_work = mask.row_work(0, lengths, lengths)
    rank_tokens = -(-layout.num_tokens // n)
    whole = (lengths <= rank_tokens) & (doc_work.double() <= float(doc_work.sum()) / n)
    best, best_score, attempts = None, None, 0
    leaders: list[tuple[Pieces, Score]] = []  # the best POLISHED plans so far, best first

    def keep(pieces: Pieces, score: Score) -> None:
        """Take a candidate plan: among the leaders if it beats one of them (the first is the best)."""
        nonlocal best, best_score
        if any(p is pieces for p, _ in leaders):
            return
        at = next((i for i, (_, s) in enumerate(leaders) if _better(score, s)), len(leaders))
        leaders.insert(at, (pieces, score))
        del leaders[POLISHED:]
        best, best_score = leaders[0]

    # Where the costlier candidates are tried: above the (unbalanced) contiguous split's max KV plus a
    # little, or above KV_HEAVY of an all-gather, or above KV_BIG of one where that is many tokens.
    allgather = layout.num_tokens - layout.num_tokens // n
    contiguous = _score(cut_stream(layout.cu_seqlens, even_sizes(layout.num_tokens, n)), layout, n, mask, whole)
    big, big_tokens = (KV_BIG_FEW, KV_BIG_FEW_TOKENS) if n <= PACK_RANKS else (KV_BIG, KV_BIG_TOKENS)
    kv_goal = min(contiguous[0][1] + KV_GOAL * allgather, KV_HEAVY * allgather, max(big * allgather, big_tokens))
    # A balanced plan within BOUND_SLACK of a lower bound (the longest document's, causal) ends the
    # search: no candidate to come could lower its KV by more.
    causal = isinstance(mask, BandMask) and mask.is_causal
    floor = causal_floor(layout, n, TOLERANCE) if causal else 0
    enough = floor * (1 + BOUND_SLACK) if floor > 0 else -1.0

    def settled() -> bool:
        return best_score is not None and not best_score[0] and best_score[1] <= enough

    # Round 0 (no pins) of the probes, then pinning rounds, until _done. Round 0 of a chunking is
    # solved once (``unpinned``); a chunking that cannot balance is not pinned.
    chunkings = _distinct_chunkings(lengths, whole, rank_tokens)
    bisections = [Chunking(0, head_back, bisect=True, window=window, late=late)
                  for (head_back, late), window in itertools.product(BISECT_HEAD_BACK, BISECT_WINDOW)
                  if (n <= WINDOW_RANKS if window else n > 2)  # two ranks, no window: the sequence plan
                  and (n <= LATE_HEAD_RANKS or not late)]
    # Packings: the sequence shares out the reserve and the documents too big to stay whole, these
    # also with their heads at the back (each rank then holds a run of a tail and one of its head),
    # and so again with them hosted by as few ranks as their work needs.
    heads = [(h, r) for h in HEAD_BACK for r in PACK_HEAD_RESERVE] if not bool(whole.all()) else []
    packings = ([Chunking(0, h, reserve=r) for h, r in [*((0.0, r) for r in PACK_RESERVE), *heads]]
                if n <= PACK_RANKS and bool(whole.any()) else [])
    hosts = _hosts(doc_work, whole, n) if packings and not bool(whole.all()) else n
    packings += [Chunking(0, h, reserve=r, hosted=True) for h in HEAD_BACK for r in PACK_HOSTED_RESERVE
                 ] if hosts < n else []
    bisected: dict[Chunking, tuple] = {}
    solved: dict[tuple, tuple | None] = {}  # (chunking, pinned) -> (pieces, score, cut), solved ahead

    def scored(plans: list[Pieces | None]) -> list[tuple | None]:
        """Each plan with its score and cut pieces (None stays None), scored in one pass."""
        some = [p for p in plans if p is not None]
        results = iter(_scores(some, layout, n, mask, whole))
        return [None if p is None else (p, *next(results)) for p in plans]

    def solve_ahead(configs: list[tuple[Chunking, torch.Tensor]]) -> None:
        """Solve sequence plans in one pass (see :func:`_sequence_plans`) for :func:`solve` to take."""
        plans = scored(_sequence_plans(layout, n, mask, configs, whole, doc_work))
        solved.update(((chunks, pinned.numpy().tobytes()), result)
                      for (chunks, pinned), result in zip(configs, plans, strict=True))

    def solve(chunks: Chunking, pinned: torch.Tensor) -> tuple | None:
        if chunks.bisect:
            if not bisected:  # every bisection at once, on the first that is tried (see _bisection_plans)
                plans = scored(_bisection_plans(layout, n, mask, whole, bisections))
                bisected.update(zip(bisections, plans, strict=True))
            return bisected[chunks]
        key = chunks, pinned.numpy().tobytes()
        if key not in solved:
            solve_ahead([(chunks, pinned)])
        return solved.pop(key)

    def in_lockstep(chains: list[Chunking], pin_to: str) -> None:
        """Every round of one pinning pass's chains, a round at a time for all of them (a chain's
        round depends only on its own previous one), for the search to replay in its order."""
        pinned = {c: torch.full_like(lengths, -1) for c in chains}
        solve_ahead([(c, pinned[c]) for c in chains if c not in unpinned])
        result = {c: unpinned.get(c) or solved.get((c, pinned[c].numpy().tobytes())) for c in chains}
        for round_ in range(PIN_ROUNDS):
            chains = [c for c in chains if result[c] is not None and _pins_again(round_, *result[c][1:])]
            for c in chains:
                pinned[c] = _pin(pinned[c].clone(), result[c][0], result[c][2], pin_to, n)
            solve_ahead([(c, pinned[c]) for c in chains])
            result = {c: solved[c, pinned[c].numpy().tobytes()] for c in chains}

    matched = n <= MATCH_RANKS
    packed_pins = {(r, False): pins for r, pins in
                   _packings(lengths, doc_work, n, whole, PACK_RESERVE, matched=matched).items()} if packings else {}
    if hosts < n:
        packed_pins.update(((r, True), pins) for r, pins in
                           _packings(lengths, doc_work, n, whole, PACK_HOSTED_RESERVE, hosts, matched=matched).items())

    def first_pins(chunks: Chunking) -> torch.Tensor:
        if not chunks.reserve:
            return torch.full_like(lengths, -1)
        return packed_pins[chunks.reserve, chunks.hosted]

    def variants():
        yield from ((c, PIN_TO[0], True, ()) for c in chunkings[:2])
        # Head-at-back layouts where a document cannot stay whole and the KV is above the goal.
        heavy = best_score is None or best_score[1] > kv_goal
        heads = [Chunking(0, h) for h in HEAD_BACK] if heavy and not bool(whole.all()) else []
        yield from ((c, PIN_TO[0], True, ()) for c in heads)
        # Recursive bisections where the KV is still above the goal (documents that fill groups of ranks).
        for chunks in bisections:
            if best_score[0] or best_score[1] > kv_goal:
                yield chunks, PIN_TO[0], True, ()
        yield from ((c, pin_to, False, (*chunkings, *heads)) for pin_to in PIN_TO for c in [*chunkings, *heads])

    unpinned: dict[Chunking, tuple] = {}
    passes = set()
    most_chunks = _most_chunks(lengths, whole, rank_tokens)

    def ahead(plans: int, depth: int = SOLVE_LEVELS) -> bool:
        """Whether solving ``plans`` sequence plans in one pass stays overhead-bound: few chunks, and
        few enough rows that :meth:`Sequence.solve` keeps ``depth`` bisection steps per call."""
        return plans * most_chunks <= LOCKSTEP_CHUNKS and (plans * (n - 1) << depth) <= SOLVE_POINTS

    probes = [*chunkings[:2], *([Chunking(0, h) for h in HEAD_BACK] if not bool(whole.all()) else [])]
    # The first probes in one pass, the packings with them (a bisection step shallower per call:
    # they are many), else the head-at-back ones ahead.
    if ahead(len(probes) + len(packings), SOLVE_LEVELS - 1):
        solve_ahead([(c, first_pins(c)) for c in (*probes, *packings)])
    elif ahead(len(probes)):
        solve_ahead([(c, first_pins(c)) for c in probes])
    for chunks, pin_to, probe, chains in variants():
        if settled():
            break
        # A pinning pass on a small layout with a long search ahead (few cut documents: a larger
        # budget; or no balanced plan yet) is solved in lockstep, then replayed in order below (it
        # stands for several solves per chain, so it pays even a step shallower than the probes).
        if chains and pin_to not in passes and ahead(len(chains), SOLVE_LEVELS - 1) and (
                best_score is None or best_score[0] or 0 < best_score[2] <= FEW_CUTS):
            passes.add(pin_to)
            in_lockstep(list(chains), pin_to)
        pinned = torch.full_like(lengths, -1)
        for round_ in range(PIN_ROUNDS + 1):
            if round_ == 0 and chunks in unpinned:
                result = unpinned[chunks]
            else:
                result = solve(chunks, pinned)
                attempts += not (probe and (chunks.head_back or chunks.bisect))  # on top of the budget
                if result is None:
                    break
                if round_ == 0:
                    unpinned[chunks] = result
            pieces, score, cut = result
            keep(pieces, score)
            if probe or not _pins_again(round_, score, cut) or _done(best_score, attempts):
                break
            pinned = _pin(pinned, pieces, cut, pin_to, n)
        if not probe and best_score is not None and _done(best_score, attempts):
            break
    if settled():
        return best
    # The packings last (solved with the first probes): they compete with the search's best but
    # never end it early, so a plan the search finds is never lost to one.
    unsolved = [(c, first_pins(c)) for c in packings if (c, first_pins(c).numpy().tobytes()) not in solved]
    if unsolved and ahead(len(unsolved), 1):  # one pass, however few bisection steps each call then takes
        solve_ahead(unsolved)
    for chunks in packings:
        result = solve(chunks, first_pins(chunks))
        if result is not None:
            keep(result[0], result[1])
    # A few documents too big to stay whole, the KV above the goal: their nested parts, pinned; and
    # the heaviest one's alone, the others shared out by the sequence (where they need more ranks
    # than the nesting leaves them: long #1 over 4 ranks, two of 2.4 and 1.7 ranks' work each,
    # 0.663 -> 0.611 of an all-gather).
    big = torch.nonzero(~whole & (lengths > 0)).flatten()
    heaviest = big[torch.argsort(doc_work[big], descending=True, stable=True)].tolist()
    if 0 < big.numel() <= NESTED_DOCS and n <= PACK_RANKS and (
            best_score is None or best_score[0] or best_score[1] > kv_goal):
        configs = len(NESTED_FILLS) * len(NESTED_MIRRORED) * (1 + len(PACK_HOSTED_RESERVE))
        result = _nested_plan(layout, n, mask, whole, doc_work, heaviest, at_once=ahead(configs, 1), best=best_score)
        if result is None and len(heaviest) > 1:
            result = _nested_plan(layout, n, mask, whole, doc_work, heaviest[:1], at_once=ahead(configs, 1),
                                  best=best_score)
        if result is not None:
            keep(result[0], result[1])
        # ... and the two heaviest nested from opposite ends, sharing a rank (doccp.plan.nested).
        if len(heaviest) > 1 and (best_score is None or best_score[0] or best_score[1] > kv_goal):
            result = _nested_plan(layout, n, mask, whole, doc_work, heaviest, best=best_score, opposed=True)
            if result is not None:
                keep(result[0], result[1])
    # Two ranks, causal: one document's head and tail on one rank, its middle on the other, next
    # to the whole documents a local search picks (doccp.plan.two_ranks).
    if n == 2 and causal and (best_score is None or best_score[0] or best_score[1] > TWO_RANKS_KV * allgather):
        for result in scored(two_rank_plans(lengths, doc_work, whole, int(even_sizes(layout.num_tokens, n)[0]))):
            keep(result[0], result[1])
    # Many documents per rank: whole ones packed by density, the heaviest trimmed (doccp.plan.trims),
    # last (it competes with every other candidate, and gates none of them), unless the best
    # plan receives nothing already.
    if best_score is None or best_score[0] or best_score[1] > 0:
        for result in scored(trimmed_packings(lengths, doc_work, n, mask, TOLERANCE)):
            keep(result[0], result[1])
    # ... and with heads cut off beforehand, where the best plan still receives much.
    if best_score is None or best_score[0] or best_score[1] > HEADS_KV * allgather:
        for result in scored(trimmed_packings(lengths, doc_work, n, mask, TOLERANCE, heads=True)):
            keep(result[0], result[1])
    # Causal: rows of cut documents traded between pairs of ranks, where that lowers the max KV
    # (doccp.plan.polish; the cuts stay): within the work tolerance where that saves POLISH_GAIN of
    # it at least, else within the plan's own busiest rank's work (free: the balance stays). The
    # next leaders are polished too: one may polish lower than the best (long #6 over 7 ranks: the
    # opposed nesting's 54041 keys polish to 51084, the sequence plan's 57946 to 48744).
    def polished(plan: Pieces, score: Score) -> tuple[Pieces, Score]:
        for cap, gain in ((POLISH_CAP * float(doc_work.sum()) / n, POLISH_GAIN), (0.0, 0.0)):
            result = scored([polish(plan.stream_normalized(), n, cap)])[0]
            if result[1][1] <= (1 - gain) * score[1] and _better(result[1], score):
                return result[0], result[1]
        return plan, score

    if causal and best_score is not None and not best_score[0] and best_score[1] > 0:
        for plan, score in [(p, s) for p, s in leaders if not s[0] and s[1] * (1 - POLISH_REACH) < best_score[1]]:
            plan, score = polished(plan, score)
            if _better(score, best_score):
                best, best_score = plan, score
    # Every document too big to stay whole nested on ranks of its own, the others packed whole around
    # the parts, the heaviest trimmed (doccp.plan.trims; a few big documents among many short ones),
    # the best of them polished on its own: after the leaders' polish, which they would otherwise join
    # (and push out a leader that polishes lower), where the best plan still receives anything.
    if heaviest and (best_score is None or best_score[0] or best_score[1] > 0):
        top = None
        for plan, score, _ in scored(_packed_around_nested(layout, n, mask, doc_work, heaviest, best_score)):
            if top is None or _better(score, top[1]):
                top = plan, score
        if top is not None:
            plan, score = polished(*top) if causal and not top[1][0] and top[1][1] > 0 else top
            if best_score is None or _better(score, best_score):
                best, best_score = plan, score
    # Heavy documents hosted whole, the other ranks shedding an even share of short heads to fill
    # their ranks (doccp.plan.hosts), where the best plan still receives anything; after the polish,
    # which lowered none of them where they win (the seeded layouts of 131k tokens over 2-16 ranks),
    # so that the plans polished before stay the ones they were.
    if best_score is None or best_score[0] or best_score[1] > 0:
        for result in scored(hosted_packings(lengths, doc_work, n, mask, TOLERANCE)):
            if best_score is None or _better(result[1], best_score):
                best, best_score = result[0], result[1]
    # No balanced plan: tiny layouts (a few documents of a few tokens per rank) can defeat the
    # search's cuts, while head_tail balances every document on its own under a causal mask.
    if best_score is None or best_score[0]:
        result = scored([head_tail(layout, n, mask)])[0]
        if best_score is None or _better(result[1], best_score):
            best = result[0]
    return best


def _distinct_chunkings(lengths: torch.Tensor, whole: torch.Tensor, rank_tokens: int) -> list[Chunking]:
    """The :data:`CHUNKS_PER_RANK` chunkings that lay the sequence out differently, in order: two
    with the same chunk size are one layout, and so are all whose chunks are no shorter than every
    document too big to stay whole (each document one chunk). On small layouts most coincide (every
    document whole: all of them), and each would be solved and pinned again for the same plans."""
    longest = int(lengths[~whole].max()) if not bool(whole.all()) else 0
    layouts = {}
    for per_rank in CHUNKS_PER_RANK:
        size = max(rank_tokens // per_rank, 1) if per_rank else longest
        layouts.setdefault(size if size < longest else 0, Chunking(per_rank))
    return list(layouts.values())


def _hosts(doc_work: torch.Tensor, whole: torch.Tensor, n: int) -> int:
    """Ranks whose work the documents too big to stay whole need, together (at least one)."""
    share = float(doc_work.sum()) / n
    return max(-(-int(doc_work[~whole].sum()) // max(int(share), 1)), 1)


def _packings(lengths: torch.Tensor, doc_work: torch.Tensor, n: int, whole: torch.Tensor,
              reserves: tuple[float, ...], hosts: int = 0, taken: tuple[torch.Tensor, torch.Tensor] | None = None,
              matched: bool = False) -> dict[float, torch.Tensor]:
    """Per reserve share ``r``: documents pinned whole to ranks, heaviest first, each to the rank
    with the most work left to fill among those it fits (tokens and work), but for a *reserve* of
    the lightest documents holding at most ``r`` of the tokens: the sequence shares those out to
    make every rank exact, so only light (short) documents are cut. Pinned rank per document, -1
    where not pinned. With ``hosts``, ranks ``0 .. hosts - 1`` (the first the sequence fills) leave
    room for an equal part of the tokens and work of the documents too big to stay whole; with
    ``taken`` (tokens and work per rank), for what parts pinned already hold.

    With ``matched``, each document goes instead to the rank with the most work left *beyond what
    its tokens left would hold at the reserve's density* (work per token): most work first leaves
    some ranks many tokens to fill with little work and others the reverse, and one reserve cannot
    fill both (sft mix, 8 ranks: densities of 9 to 1,100 needed of a reserve of 105); matched, every
    rank is left needing about the reserve's own density, which the sequence can share out.

    One greedy pass serves every share packed at the same density (a reserve is a tail of the
    heaviest-first order, so each share's pass is a prefix of the longest; matched, each reserve
    has a density of its own); a few heap operations per document, for at most :data:`PACK_DOCS`
    documents (lighter ones join the reserve)."""
    total = int(lengths.sum())
    heaviest = torch.argsort(doc_work, descending=True, stable=True)
    lighter = torch.flip(torch.cumsum(torch.flip(lengths[heaviest], [0]), 0), [0])  # tokens from here on
    ends = {r: min(int(torch.searchsorted(-lighter, -int(r * total))), PACK_DOCS) for r in reserves}
    tokens_left = even_sizes(total, n).tolist()
    work_left = [float(doc_work.sum()) / n] * n
    for r in range(hosts):
        tokens_left[r] -= int(lengths[~whole].sum()) // hosts
        work_left[r] -= float(doc_work[~whole].sum()) / hosts
    if taken is not None:
        tokens_left = [t - held for t, held in zip(tokens_left, taken[0].tolist(), strict=True)]
        work_left = [w - held for w, held in zip(work_left, taken[1].tolist(), strict=True)]
    passes: dict[float, torch.Tensor] = {}  # the greedy at one density, over its longest prefix
    packings = {}
    for r, end in sorted(ends.items(), key=lambda share: -share[1]):
        rest = heaviest[end:][whole[heaviest[end:]]]
        density = float(doc_work[rest].sum()) / max(float(lengths[rest].sum()), 1.0) if matched else 0.0
        if density not in passes:
            passes[density] = _pack(lengths, doc_work, whole, heaviest[:end], list(tokens_left), list(work_left),
                                    density)
        packings[r] = torch.full_like(lengths, -1).index_copy_(0, heaviest[:end], passes[density][:end])
    return packings


def _pack(lengths: torch.Tensor, doc_work: torch.Tensor, whole: torch.Tensor, docs: torch.Tensor,
          tokens_left: list[int], work_left: list[float], density: float) -> torch.Tensor:
    """The greedy of :func:`_packings`: each of ``docs`` (heaviest first) that can stay whole to
    the rank with the most ``work_left - density * tokens_left`` among those it fits (tokens and
    work); the rank of each, -1 where none fits."""
    heap = [(density * t - w, r) for r, (t, w) in enumerate(zip(tokens_left, work_left, strict=True))]
    heapq.heapify(heap)  # the rank with the most left first
    owner = [-1] * docs.numel()
    for i, (length, work, fits) in enumerate(zip(lengths[docs].tolist(), doc_work[docs].tolist(),
                                                 (whole[docs] & (lengths[docs] > 0)).tolist(), strict=True)):
        if not fits:
            continue
        skipped = []
        while heap and not (tokens_left[heap[0][1]] >= length and work_left[heap[0][1]] >= work):
            skipped.append(heapq.heappop(heap))
        if heap:
            _, r = heapq.heappop(heap)
            owner[i], tokens_left[r], work_left[r] = r, tokens_left[r] - length, work_left[r] - work
            heapq.heappush(heap, (density * tokens_left[r] - work_left[r], r))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return torch.tensor(owner, dtype=torch.int64)


def _most_chunks(lengths: torch.Tensor, whole: torch.Tensor, rank_tokens: int) -> int:
    """Chunks of a sequence under the finest :data:`CHUNKS_PER_RANK` (more than under any other
    chunking): documents that can stay whole are one chunk each, the others are cut finely."""
    size = max(rank_tokens // max(CHUNKS_PER_RANK), 1)
    return int(whole.sum()) + int((-(-lengths[~whole] // size)).sum())


def _nested_plan(layout: DocLayout, n: int, mask: Mask, whole: torch.Tensor, doc_work: torch.Tensor,
                 docs: list[int], at_once: bool = True, best: tuple | None = None, opposed: bool = False
                 ) -> tuple | None:
    """The best plan that pins the nested parts of documents ``docs`` (:mod:`doccp.plan.nested`;
    each on ranks of its own, see :func:`_nested_layouts`, and mirrored, see :data:`NESTED_MIRRORED`;
    sized for a work cap between the mean
    and the tolerance, the other documents filling up at each of :data:`NESTED_FILLS` of their
    mean work per token): the sequence shares out every other document, or only a reserve of the
    lightest after the rest is packed whole around the parts (:func:`_packings`); with its score
    and cut pieces, or None. ``at_once``: the plans solved in one pass (else one at a time);
    ``best``: the score to beat (parts whose own KV shows that no plan pinning them can are
    skipped); ``opposed``: the first two of ``docs`` nested from opposite ends instead, sharing a
    rank (:func:`~doccp.plan.nested.opposed_parts`)."""
    lengths, total = layout.lengths, float(doc_work.sum())
    fill, cap, limit = _nesting(layout, n, doc_work, docs, best)
    configs, parts_of, sized = [], [], set()
    if opposed:  # every rank but the shared one holds parts only: its work is known, not estimated
        rest = total - float(doc_work[docs[0]] + doc_work[docs[1]])
        layouts = [p for p in opposed_parts((docs[0], docs[1]), (int(lengths[docs[0]]), int(lengths[docs[1]])),
                                            even_sizes(layout.num_tokens, n), POLISH_CAP * total / n, rest, mask)
                   if limit is None or _least_kv(p) <= limit]
    else:
        layouts = [p for p in _nested_layouts(docs, lengths, even_sizes(layout.num_tokens, n), cap,
                                              [fill * f for f in NESTED_FILLS], mask, limit) if p is not None]
    for parts in [Pieces(n - 1 - p.rank if mirrored else p.rank, p.doc, p.start, p.end)
                  for mirrored in NESTED_MIRRORED for p in layouts]:
        key = parts.start.numpy().tobytes() + parts.rank.numpy().tobytes()
        if key in sized:  # (a lighter fill may size the same parts)
            continue
        sized.add(key)
        work = mask.row_work(parts.start, parts.end, lengths.index_select(0, parts.doc)).double()
        taken = (torch.zeros(n, dtype=torch.int64).index_add_(0, parts.rank, parts.length),
                 torch.zeros(n, dtype=torch.float64).index_add_(0, parts.rank, work))
        packed = _packings(lengths, doc_work, n, whole, PACK_HOSTED_RESERVE, taken=taken)
        configs += [(Chunking(0), p) for p in (torch.full_like(lengths, -1), *packed.values())]
        parts_of += [parts] * (1 + len(packed))
    if not configs:
        return None
    batches = [range(len(configs))] if at_once else [[i] for i in range(len(configs))]
    plans = [p for batch in batches for p in _sequence_plans(layout, n, mask, [configs[i] for i in batch], whole,
                                                              doc_work, [parts_of[i] for i in batch]) if p is not None]
    best = None
    for plan, (score, cut) in zip(plans, _scores(plans, layout, n, mask, whole), strict=True):
        if best is None or _better(score, best[1]):
            best = (plan, score, cut)
    return best


def _nesting(layout: DocLayout, n: int, doc_work: torch.Tensor, docs: list[int], best: tuple | None
             ) -> tuple[float, float, float | None]:
    """What the nested parts of ``docs`` are sized for: the other documents' mean work per token,
    the work cap of a rank holding parts, and the most KV their own holders may lack (parts above it
    cannot win against ``best``, the score to beat, :func:`_better`; None: no limit)."""
    lengths, total = layout.lengths, float(doc_work.sum())
    index = torch.tensor(docs, dtype=torch.int64)
    fill = (total - float(doc_work[index].sum())) / max(layout.num_tokens - int(lengths[index].sum()), 1)
    cap = (1 + (TOLERANCE - 1) * NESTED_CAP) * total / n
    limit = None if best is None or best[0] else best[1] * (1 + KV_SLACK) if best[2] else best[1]
    return fill, cap, limit


def _packed_around_nested(layout: DocLayout, n: int, mask: Mask, doc_work: torch.Tensor, docs: list[int],
                          best: tuple | None) -> list[Pieces]:
    """Plans that pin the nested parts of ``docs`` (each on ranks of its own, per fill density of
    :data:`NESTED_FILLS`, :func:`_nested_layouts`) and pack every other document around them whole,
    the heaviest trimmed (:func:`~doccp.plan.trims.packings_around`): where the rooms beside the
    parts are many and uneven, whole documents fill them closer than the sequence's cuts. Lighter
    fills size bigger parts, which leave less room: after the first that no packing balances, none
    is tried."""
    def placements():  # (sized once the packing is known to run: lazily)
        fill, cap, limit = _nesting(layout, n, doc_work, docs, best)
        sized = set()  # (a lighter fill may size the same parts)
        for parts in _nested_layouts(docs, layout.lengths, even_sizes(layout.num_tokens, n), cap,
                                     [fill * f for f in NESTED_FILLS], mask, limit):
            key = None if parts is None else parts.start.numpy().tobytes() + parts.rank.numpy().tobytes()
            if key is not None and key not in sized:
                sized.add(key)
                yield parts

    plans = []
    for packed in packings_around(layout.lengths, doc_work, n, mask, TOLERANCE, placements()):
        if not packed:
            break
        plans += packed
    return plans


def _nested_layouts(docs: list[int], lengths: torch.Tensor, rank_tokens: torch.Tensor, cap: float,
                    fills: list[float], mask: Mask, limit: float | None = None) -> list[Pieces | None]:
    """Per fill density, the nested parts of every document of ``docs`` on ranks of its own: the
    first from rank 0, each next one from the rank after the last one the one before it uses; None
    where a document does not fit the ranks left, or where a holder of its parts would receive
    more than ``limit`` of it (then no plan pinning them can win). Each document is sized for every
    density in one pass, each density on the ranks its previous document leaves."""
    n = rank_tokens.numel()
    pieces: list[list[Pieces]] = [[] for _ in fills]
    first: list[int | None] = [0] * len(fills)  # per density, the rank the next document starts on
    for doc in docs:
        live = [i for i, r in enumerate(first) if r is not None and r < n]
        if not live:
            return [None] * len(fills)
        # Each density's ranks from its first on, padded with ranks of no tokens (none of it goes there).
        rows = torch.stack([torch.cat([rank_tokens[first[i]:], rank_tokens.new_zeros(first[i])]) for i in live])
        sized = nested_parts(doc, int(lengths[doc]), rows, cap, [fills[i] for i in live], mask)
        first = [None if i not in live else first[i] for i in range(len(fills))]
        for i, parts in zip(live, sized, strict=True):
            if parts is None or (limit is not None and _least_kv(parts) > limit):
                first[i] = None
            else:
                pieces[i].append(Pieces(parts.rank + first[i], parts.doc, parts.start, parts.end))
                first[i] += int(parts.rank.max()) + 1
    return [None if r is None else Pieces.cat(p) for p, r in zip(pieces, first, strict=True)]


def _least_kv(parts: Pieces) -> int:
    """The most keys of its document a holder of one document's ``parts`` lacks below its highest
    row (under a prefix mask it receives them in every plan that pins these parts)."""
    ranks = int(parts.rank.max()) + 1
    top = torch.zeros(ranks, dtype=torch.int64).scatter_reduce_(0, parts.rank, parts.end, "amax")
    return int((top - torch.zeros(ranks, dtype=torch.int64).index_add_(0, parts.rank, parts.length)).max())


def _pins_again(round_: int, score: Score, cut: torch.Tensor) -> bool:
    """Whether a pinning chain solves again after this round: it cut a document that could stay
    whole (and, in its first round, balanced)."""
    return round_ < PIN_ROUNDS and not (round_ == 0 and score[0]) and bool(cut.any())


def _pin(pinned: torch.Tensor, pieces: Pieces, cut: torch.Tensor, pin_to: str, n: int) -> torch.Tensor:
    """``pinned`` with every cut document that could stay whole pinned to one rank (see PIN_TO)."""
    part = pieces.select(cut)
    if pin_to == "most":
        most = torch.zeros_like(pinned).scatter_reduce(0, part.doc, part.length, "amax", include_self=True)
        owner = part.select(part.length == most[part.doc])
        pinned[owner.doc] = owner.rank
    elif pin_to == "first":
        first = torch.full_like(pinned, n).scatter_reduce(0, part.doc, part.rank, "amin", include_self=True)
        pinned[part.doc] = first[part.doc]
    else:
        pinned[part.doc] = 0
    return pinned


def _score(pieces: Pieces, layout: DocLayout, n: int, mask: Mask, whole: torch.Tensor) -> tuple[Score, torch.Tensor]:
    """(unbalanced, max KV received, documents that could stay whole but are cut, work spread):
    what the planner minimises, in that order; and which pieces cut such documents. *Unbalanced*
    is 0 for a plan within the tolerance, else its spread in steps of the tolerance
    (:func:`_unbalanced`)."""
    return _scores([pieces], layout, n, mask, whole)[0]


def _scores(plans: list[Pieces], layout: DocLayout, n: int, mask: Mask, whole: torch.Tensor
            ) -> list[tuple[Score, torch.Tensor]]:
    """:func:`_score` of several plans in one pass: plan ``i``'s ranks as ``i * n + rank`` of one
    table (small layouts are bound by the per-call overhead of scoring, not its width)."""
    if not plans:
        return []
    m, lengths = len(plans), layout.lengths
    # Pieces.normalized sorts by (rank, doc, start) as one int64 key: as many plans at once as it holds.
    at_once = max(SCORE_KEY_LIMIT // (n * (layout.num_docs + 1) * (int(lengths.max()) + 2)), 1)
    if m > at_once:
        return [r for i in range(0, m, at_once) for r in _scores(plans[i:i + at_once], layout, n, mask, whole)]
    sizes = [len(p) for p in plans]
    of_plan = torch.arange(m).repeat_interleave(torch.tensor(sizes))
    pieces = Pieces.cat(plans) if m > 1 else plans[0]
    pieces = Pieces(pieces.rank + of_plan * n, pieces.doc, pieces.start, pieces.end) if m > 1 else pieces
    doc_len = _at(lengths, pieces.doc)
    work = torch.zeros(m * n, dtype=torch.float64).index_add_(
        0, pieces.rank, mask.row_work(pieces.start, pieces.end, doc_len).double()).view(m, n)
    spread = (work.max(1).values / work.mean(1).clamp(min=1.0)).tolist()
    p = pieces.normalized()
    seen = visible_intervals(p, lengths, mask)
    kv = torch.zeros(m * n, dtype=torch.int64).index_add_(0, seen.rank, seen.length).index_add_(0, p.rank, -p.length)
    cut = _at(whole, pieces.doc) & (pieces.length < doc_len)
    at = torch.nonzero(cut).flatten()
    cut_docs = torch.unique(_at(of_plan, at) * max(layout.num_docs, 1) + _at(pieces.doc, at)) // max(layout.num_docs, 1)
    cuts = torch.bincount(cut_docs, minlength=m).tolist()
    return [((_unbalanced(s), most, c, s), one_cut) for s, most, c, one_cut in
            zip(spread, kv.view(m, n).max(1).values.tolist(), cuts, torch.split(cut, sizes), strict=True)]


def _unbalanced(spread: float) -> int:
    """0 for a work spread (max/mean) within :data:`TOLERANCE`, else ``k >= 1`` for a spread in
    ``(TOLERANCE^k, TOLERANCE^(k + 1)]``. Where no candidate balances (a few tokens per rank), plans
    are compared by this first: the search keeps the one nearest balance, to the tolerance, and of
    those the least KV (23 ranks, 1550 tokens, documents up to 321, a full mask: 1.014 for 740 keys,
    where the least KV of any candidate, 558, came at a spread of 1.71)."""
    return 0 if spread <= TOLERANCE else max(int(math.log(spread) / math.log(TOLERANCE)), 1)


def _better(score: Score, best: Score) -> bool:
    """Whether a plan scored ``score`` beats the best so far: lexicographic on :func:`_score`,
    except that a plan cutting fewer documents that could stay whole wins while its max KV is
    within ``KV_SLACK`` and ``KV_SLACK_TOKENS`` of the other's (short documents stay whole for a
    few % of KV, not for much traffic)."""
    if score[0] != best[0]:
        return score[0] < best[0]
    lo, hi = min(score[1], best[1]), max(score[1], best[1])
    if score[2] != best[2] and lo * (1 + KV_SLACK) >= hi and hi - lo <= KV_SLACK_TOKENS:
        return score[2] < best[2]
    return score < best


def _done(score: Score, attempts: int) -> bool:
    """Whether the search stops at the best plan so far, scored by :func:`_score`."""
    unbalanced, _, cut, _ = score
    return not unbalanced and (cut == 0 or attempts >= (ATTEMPTS_FEW_CUTS if cut <= FEW_CUTS else ATTEMPTS))


def _sequence_plan(layout: DocLayout, n: int, mask: Mask, chunking: Chunking, whole: torch.Tensor,
                   pinned: torch.Tensor, doc_work: torch.Tensor) -> Pieces | None:
    """One sequence plan (see :func:`_sequence_plans`)."""
    return _sequence_plans(layout, n, mask, [(chunking, pinned)], whole, doc_work)[0]


def _sequence_plans(layout: DocLayout, n: int, mask: Mask, configs: list[tuple[Chunking, torch.Tensor]],
                    whole: torch.Tensor, doc_work: torch.Tensor, parts: list[Pieces] | None = None
                    ) -> list[Pieces | None]:
    """The plan of the module docstring for each ``(chunking, pinned)``: documents ``pinned`` to a
    rank (>= 0) are that rank's, whole, and the sequence shares out the rest (None when the pinned
    ones overfill a rank). ``parts``: per configuration, pieces pinned too (their documents all
    pinned that way, e.g. :func:`~doccp.plan.nested.nested_parts`).

    Several configurations are solved in one pass, each as a group of a sequence of its own
    (rows never interact), so they cost one round of vectorised calls: small layouts are bound by
    the per-call overhead of that work, and each plan is the one it gets alone."""
    lengths = layout.lengths
    mean = float(doc_work.sum()) / n
    plans: list[Pieces | None] = [None] * len(configs)
    live, pins, tokens, need, layouts = [], [], [], [], []
    for i, (chunking, pinned) in enumerate(configs):
        held = pinned >= 0
        p = Pieces.of(pinned[held], torch.nonzero(held).flatten(), 0, lengths[held])
        if parts is not None:
            p = Pieces.cat([p, parts[i]])
            held = held.clone().index_fill_(0, parts[i].doc, True)
        t = even_sizes(layout.num_tokens, n) - torch.zeros(n, dtype=torch.int64).index_add_(0, p.rank, p.length)
        if bool((t < 0).any()):
            continue
        rest = torch.where(held, 0, lengths)
        if not bool(rest.any()):  # every token pinned (then every rank's share is pinned exactly)
            plans[i] = p
            continue
        live.append(i)
        pins.append(p)
        tokens.append(t)
        work = mask.row_work(p.start, p.end, lengths[p.doc]).double()
        need.append(mean - torch.zeros(n, dtype=torch.float64).index_add_(0, p.rank, work))
        layouts.append((chunking, rest))  # its documents left to the sequence
    if not live:
        return plans
    m = len(live)
    seq = Sequence.of_layouts(layouts, lengths, mask, -(-layout.num_tokens // n), whole)
    tokens, need = torch.stack(tokens), torch.stack(need)
    k = torch.cumsum(tokens, 1)[:, :-1].flatten()  # per plan, tokens of ranks 0..r, r < N - 1
    goal = torch.cumsum(need, 1)[:, :-1].flatten()
    g = torch.arange(m).repeat_interleave(n - 1) if m > 1 else None  # one plan: the whole sequence
    # Roots made monotone first (a cut solved again lands anywhere: snapping then moves it too).
    x = _monotone(seq, seq.solve(k, goal, torch.zeros_like(k), k.clone(), g), k, goal, g)
    # Snapping moves cuts within the slack, but may push one past its neighbour; then the
    # unsnapped cuts are kept (per plan).
    snapped = _monotone(seq, seq.snap(x, k, goal, SNAP_SLACK * mean, g), k, goal, g)
    keep = _excess(seq, snapped, k, need, g) <= SNAP_BUDGET * mean
    if not bool(keep.all()):
        snapped = torch.where(keep.repeat_interleave(n - 1), snapped, x)
    x, k = snapped.view(m, n - 1), k.view(m, n - 1)
    total = seq.group_bounds(None)[1][:, None]
    y = x + total - k
    zero = x.new_zeros(m, 1)
    sizes = torch.cat([torch.diff(x, prepend=zero), y[:, -1:] - x[:, -1:], torch.diff(y.flip(1), append=total)], 1)
    ranks = torch.cat([torch.arange(n - 1), torch.tensor([n - 1]), torch.arange(n - 2, -1, -1)])
    cut = cut_stream(seq.cu, sizes.flatten())
    of_plan = cut.rank // (2 * n - 1)
    pieces = seq.pieces(cut, ranks.repeat(m))
    for i, (at, p) in enumerate(zip(live, pins, strict=True)):
        plans[at] = Pieces.cat([pieces.select(of_plan == i) if m > 1 else pieces, p])
    return plans


def _bisection_plan(layout: DocLayout, n: int, mask: Mask, whole: torch.Tensor, head_back: float = 0.0,
                    window: bool = False, late: bool = False) -> Pieces:
    """One bisection plan (see :func:`_bisection_plans`)."""
    return _bisection_plans(layout, n, mask, whole, [Chunking(0, head_back, True, window, late)])[0]


def _bisection_plans(layout: DocLayout, n: int, mask: Mask, whole: torch.Tensor,
                     variants: list[Chunking]) -> list[Pieces]:
    """Recursive bisection: a group of ``k`` ranks gives its first ``h`` ranks a front run and a
    back run of *its own* sequence (its chunks sorted by density) with their share of the
    group's tokens and work, the rest the middle; every group of a level is solved at once.

    Per group, every ``h`` of the middle half is tried, each with the cut pair the bisection
    finds and with cut pairs that keep a big chunk whole (one cut on its boundary); the pair
    cutting least KV wins, and it may miss the work share by what the group's ranks can absorb
    (the groups below share the group's actual work; :data:`BISECT_BUDGET` in all). So a
    document goes whole to a group of ranks sized for it, its head and tail together::

        two documents A, B of half the tokens each, N = 4 (one global sequence gives every
        rank part of both: each receives most of both prefixes)
        level 1: ranks 0-1 <- A whole (+ a little of B's cheap head), ranks 2-3 <- the rest of B
        level 2: within each group, front + back: A's tail and head on one rank, its middle on the other

    With ``head_back``, a document that cannot stay whole starts as two chunks, its tail and its
    first ``head_back`` share (the head), and heads sort after every other chunk of their group
    (as in :class:`Chunking`): the ranks that take the tail from the front take the head too.

    With ``window``, the first ``h`` ranks may also take a front run ending at a big chunk's edge
    and a *window* ``[u, u + len)`` of the rest of the sequence instead of its back run, ``u``
    solved for the work (the window's work falls as it slides to the light end), the others
    the gap before it and the rest after it. Front + back pairs the big chunks with the
    lightest; where those weigh too little, the front must reach into the next big document
    (its tail: the rank receives nearly all of its prefix), while the window takes denser
    light documents instead and cuts only two of them::

        pretrain mix, N = 4: A (0.88 of a rank's work) + the lightest documents miss 4% of the
        work; front + back took the last 314 tokens of B (0.78) too: 0.117 of an all-gather
        received. A + a window of mid-density documents: 0.023 (contiguous, unbalanced: 0.016)

    With ``late``, no head is split off at first: where a group of two ranks is about to split,
    each chunk of a document that cannot stay whole gives its first ``head_back`` share to the
    back of that group's sequence. Early heads all trail the first level's sequence, so a group
    sized for one big document takes another's head with its back run; late, each big document
    first goes whole to a group of its own, then head and tail to one rank of it::

        pretrain mix, N = 4, documents of 38k and 35k tokens (1.97 and 1.65 ranks' work): early heads,
        ranks 0-1 hold the 38k one and the 35k one's head: 0.261 of an all-gather; late heads,
        each document in a group of two, head + tail on one rank, the middle on the other: 0.203

    Several ``variants`` (head share, window, late: the :class:`Chunking` of each) are solved in
    one pass, each from a rank group of its own (groups never interact), so a level costs one
    round of vectorised calls for all of them: planning is bound by the per-call overhead where
    the groups are few, and the variants' plans are the ones each gets alone.
    """
    lengths = layout.lengths
    rank_cu = torch.cat([lengths.new_zeros(1), torch.cumsum(even_sizes(layout.num_tokens, n), 0)])
    m = len(variants)
    # The rank groups (first rank, ranks, the variant they plan for), one per variant at first.
    first, count, variant = lengths.new_zeros(m), lengths.new_full((m,), n), torch.arange(m)
    budget = torch.full((m,), BISECT_BUDGET, dtype=torch.float64)  # relative work error a group may still take
    head_back = torch.tensor([v.head_back for v in variants], dtype=torch.float32)
    late = torch.tensor([v.late and v.head_back > 0 for v in variants])
    window = torch.tensor([v.window for v in variants])
    doc = torch.nonzero(lengths > 0).flatten()
    # Chunks (rank: the chunk's group): every document, or its tail and then its head (a last chunk).
    parts, head = [], []
    for i, v in enumerate(variants):
        head_end = torch.where(whole | v.late, 0, (lengths * v.head_back).long())
        heads = doc[head_end[doc] > 0]
        parts += [Pieces.of(i, doc, head_end[doc], lengths[doc]), Pieces.of(i, heads, 0, head_end[heads])]
        head += [torch.zeros(doc.numel(), dtype=torch.bool), torch.ones(heads.numel(), dtype=torch.bool)]
    chunks, head = Pieces.cat(parts), torch.cat(head)
    slack = SNAP_SLACK * float(mask.row_work(0, lengths, lengths).sum()) / n
    while bool((count > 1).any()):
        if bool(late.any()):  # groups of two ranks: each big document's chunk gives its head to the back
            group_variant = _at(variant, chunks.rank)
            big = (_at(late, group_variant) & (_at(count, chunks.rank) == 2) & ~_at(whole, chunks.doc) & ~head
                   & (chunks.length > 1))
            mid = chunks.start + (chunks.length * _at(head_back, group_variant)).long().clamp(min=1)
            tails = Pieces(chunks.rank, chunks.doc, torch.where(big, mid, chunks.start), chunks.end)
            b = torch.nonzero(big).flatten()
            chunks = Pieces.cat([tails, Pieces(*(_at(c, b) for c in (chunks.rank, chunks.doc, chunks.start, mid)))])
            head = torch.cat([head, torch.ones(b.numel(), dtype=torch.bool)])
        seq = Sequence(chunks.doc, chunks.start, chunks.end, lengths, whole, mask, group=chunks.rank,
                       groups=count.numel(), last=head if bool((head_back > 0).any()) else None)
        split = count > 1
        g, h, k, x, u, used = _group_splits(seq, rank_cu, first, count, budget, slack, window[variant], variant)
        # Cut every group's sequence into front | gap | window | rest, the first h ranks' runs and
        # the others' in turn (one run for a group of one rank).
        tokens = seq.group_bounds(None)[1]
        front, gap, span = tokens.clone(), torch.zeros_like(tokens), torch.zeros_like(tokens)
        front[g], gap[g], span[g] = x, u - x, k - x
        rest = tokens - front - gap - span
        new = torch.cumsum(1 + split.long(), 0) - 1 - split.long()  # first new group of each group
        labels = torch.stack([new, new + 1, new, new + 1], 1).flatten()
        cut = cut_stream(seq.cu, torch.stack([front, gap, span, rest], 1).flatten())
        chunks, head = seq.pieces(cut, labels), _at(seq.last, cut.doc)
        size = int(new[-1]) + 1 + int(split[-1])
        a, b = new[g], new[g] + 1  # the split groups' halves
        first, count, budget, variant = (t.new_zeros(size).index_copy_(0, new, t)
                                         for t in (first, count, budget, variant))
        first[b], count[b], budget[b], variant[b] = first[a] + h, count[a] - h, budget[a] - used, variant[a]
        count[a], budget[a] = h, budget[b]
    plans = Pieces(_at(first, chunks.rank), chunks.doc, chunks.start, chunks.end)
    of_chunk = _at(variant, chunks.rank)
    return [plans.select(of_chunk == i) for i in range(m)]


def _group_splits(seq: Sequence, rank_cu: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                  budget: torch.Tensor, slack: float, window: torch.Tensor, variant: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    """For every group of more than one rank: ``(group, h, tokens of its first h ranks, front
    cut, window start, relative work error taken)`` of its best split (see :func:`_bisection_plans`;
    for a group without ``window``, the window is the back run). ``variant``: the plan each group
    is part of (the groups of one plan share the scale of their tie-break)."""
    # Candidate splits: the first h ranks, h within the middle half (at most SPLIT_TRIES, evenly spaced).
    low = (count // 4).clamp(min=1)
    span = count - 2 * low
    tries = torch.where(count > 1, (span + 1).clamp(max=SPLIT_TRIES), 0)
    g = repeat(torch.arange(count.numel()), tries)
    h = low[g] + expand(torch.zeros_like(tries), tries) * span[g] // (tries[g] - 1).clamp(min=1)
    k = rank_cu[first[g] + h] - rank_cu[first[g]]
    base, tokens, work0, work1 = seq.group_bounds(g)
    goal = (work1 - work0) * h.double() / count[g].double()

    def each(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, goal, g) repeated for ``x`` of shape [candidates, width]."""
        return tuple(t.repeat_interleave(x.shape[1]) for t in (k, goal, g))

    # The held work need not be monotone in x: a root in every bracket where it crosses the goal.
    grid = k[:, None] * torch.arange(BRACKETS + 1) // BRACKETS
    k_, goal_, g_ = each(grid)
    miss = (seq.held(grid.flatten(), k_, g_) - goal_).view(grid.shape)
    above = miss >= 0
    crosses = above[:, 1:] != above[:, :-1]
    none = torch.nonzero(~crosses.any(1)).flatten()  # no crossing: the bracket of the closest grid point
    crosses[none, miss[none].abs().argmin(1).clamp(max=BRACKETS - 1)] = True
    # Solved only where it crosses (a bracket without a crossing keeps its start and is never valid).
    at = torch.nonzero(crosses.flatten()).flatten()
    k_, goal_, g_ = (t.index_select(0, at) for t in each(crosses))
    starts = grid[:, :-1].flatten()
    rising = (~above[:, :-1]).flatten().index_select(0, at)
    found = seq.solve(k_, goal_, starts.index_select(0, at), grid[:, 1:].flatten().index_select(0, at), g_, rising)
    roots = starts.index_copy(0, at, seq.snap(found, k_, goal_, slack, g_)).view(crosses.shape)
    # And cut pairs keeping a big chunk whole: its edges as the front or as the back cut.
    edges = _big_chunk_edges(seq, count.numel())[g] - base[:, None]
    rest = (tokens - k)[:, None]
    x = torch.cat([roots, edges, edges - rest], 1)
    valid = torch.cat([crosses, edges <= k[:, None], edges >= rest], 1)
    x = x.clamp(min=0).minimum(k[:, None])
    u = x + rest  # the back run: a window at the very end
    usable = (edges <= k[:, None]) & window[g][:, None]  # window candidates that can be valid
    if bool(usable.any()):  # a big chunk's edge as the front cut and the window after it that meets the work
        front = edges.clamp(min=0).minimum(k[:, None])
        entry = torch.nonzero(usable.flatten()).flatten()  # solved for those only (the others stay invalid)
        row = entry // front.shape[1]
        at = front.flatten().index_select(0, entry)
        k_, goal_, g_ = (t.index_select(0, row) for t in (k, goal, g))
        found = seq.solve(k_, goal_, at, at + rest.flatten().index_select(0, row), g_, False, at)
        start = front.flatten().index_copy(0, entry, seq.snap(found, k_, goal_, slack, g_, at)).view(front.shape)
        x, u = torch.cat([x, front], 1), torch.cat([u, start], 1)
        valid = torch.cat([valid, usable], 1)
    # The work error and the cost of the valid candidates only (most brackets hold no crossing):
    # the others are never picked, as every row keeps a valid root (its crossing or its closest
    # bracket), and they stay at 0 (no NaN: a row's keys compare).
    at = torch.nonzero(valid.flatten()).flatten()
    row = at // x.shape[1]
    xs, us, ks = x.flatten().index_select(0, at), u.flatten().index_select(0, at), k.index_select(0, row)
    err = (seq.held(xs, ks, g.index_select(0, row), us) - goal.index_select(0, row)).abs()
    scale = torch.minimum(goal, work1 - work0 - goal).clamp(min=1.0).index_select(0, row)
    rel = torch.zeros(x.numel(), dtype=torch.float64).index_copy_(0, at, err / scale).view(x.shape)
    valid &= (rel <= budget[g][:, None]) | (torch.arange(x.shape[1]) < BRACKETS)  # roots: within the slack
    ends = base.index_select(0, row) + torch.stack([xs, us, us + ks - xs])
    cost = torch.zeros(x.numel(), dtype=torch.float64).index_copy_(0, at, seq.cut_cost(ends).sum(0)).view(x.shape)
    # Per group: least KV (documents that could stay whole first), then the most even h, the least error.
    widest = torch.zeros_like(count).scatter_reduce(0, variant, count, "amax")  # per plan
    key = torch.where(valid, cost, torch.inf) * (2 * widest[variant[g]]).double()[:, None] + rel.clamp(max=0.5)
    key += (2 * h - count[g]).abs().double()[:, None]
    row_best, col = key.min(1)
    best = torch.full((count.numel(),), torch.inf, dtype=torch.float64).scatter_reduce(0, g, row_best, "amin")
    pick = torch.nonzero(row_best == best[g]).flatten()
    pick = pick[torch.cat([torch.ones(1, dtype=torch.bool), g[pick[1:]] != g[pick[:-1]]])]  # first per group
    return g[pick], h[pick], k[pick], x[pick, col[pick]], u[pick, col[pick]], rel[pick, col[pick]]


def _big_chunk_edges(seq: Sequence, groups: int) -> torch.Tensor:
    """Sequence positions of both edges of each group's :data:`BIG_CHUNKS` longest chunks
    (``[groups, 2 * BIG_CHUNKS]``; a group with fewer chunks repeats its first edge)."""
    chunk_group = repeat(torch.arange(groups), torch.diff(seq.group_chunks))
    order = torch.argsort(seq.lengths, descending=True, stable=True)
    order = order[torch.argsort(chunk_group[order], stable=True)]  # by group, longest first
    rank = torch.arange(order.numel()) - seq.group_chunks[chunk_group[order]]
    keep = rank < BIG_CHUNKS
    edges = seq.group_cu[:-1, None].repeat(1, 2 * BIG_CHUNKS)
    i = order[keep]
    edges[chunk_group[i], rank[keep]] = seq.cu[i]
    edges[chunk_group[i], BIG_CHUNKS + rank[keep]] = seq.cu[i + 1]
    return edges


def _at(column: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``column[index]`` for an index tensor of any shape, by ``index_select``: the search makes
    thousands of these small gathers, each ~2x cheaper than advanced indexing."""
    if index.dim() == 1:
        return column.index_select(0, index)
    return column.index_select(0, index.reshape(-1)).view(index.shape)


def _column(v: torch.Tensor | int) -> torch.Tensor:
    """``v`` (per row, or one scalar for all) as a column that broadcasts against ``[rows, width]``."""
    return torch.as_tensor(v).reshape(-1, 1)


def _excess(seq: Sequence, x: torch.Tensor, k: torch.Tensor, need: torch.Tensor, g: torch.Tensor | None
            ) -> torch.Tensor:
    """Most work any rank holds beyond its need, for front cuts ``x`` of plans ``g`` (rows of
    ``N - 1`` ranks per plan, ``need`` ``[plans, N]``): one figure per plan."""
    work0, work1 = seq.group_bounds(None)[2:]
    held = seq.held(x, k, g).view(need.shape[0], -1)
    held = torch.cat([held.new_zeros(held.shape[0], 1), held, (work1 - work0)[:, None]], 1)
    return (torch.diff(held, dim=1) - need).max(1).values


def _monotone(seq: Sequence, x: torch.Tensor, k: torch.Tensor, goal: torch.Tensor, g: torch.Tensor | None
              ) -> torch.Tensor:
    """Cuts whose front and back runs all have non-negative length (``x`` and ``k - x`` never
    decrease within a plan ``g``, None: one; rows of the same number of ranks per plan). The held work need
    not grow with ``x``, so the bisection may pick a root behind the previous rank's cut (or too
    far ahead of it). The first of each run of such offenders is solved again, in rounds: either
    inside the window the previous cut leaves it, or, where its own root is kept, the previous
    rank inside the window between its predecessor's cut and that root (the previous rank has
    roots of its own to choose from), whichever holds its work closer to the goal; each window
    is searched on a grid for a crossing first (:func:`_solve_within`). Whatever is left after
    :data:`MONOTONE_ROUNDS` is clamped (a plan that loses its balance that way scores as
    unbalanced and another one is kept)."""
    plans = 1 if g is None else int(g[-1]) + 1
    kk = k.view(plans, -1)
    tokens = torch.diff(kk, dim=1, prepend=kk.new_zeros(plans, 1)).flatten()
    rank = torch.arange(k.numel()) % kk.shape[1]
    for _ in range(MONOTONE_ROUNDS):
        xx = x.view(plans, -1)
        lo = torch.cat([xx.new_zeros(plans, 1), xx[:, :-1]], 1).flatten()
        bad = (x < lo) | (x > lo + tokens)
        if not bool(bad.any()):
            return x
        # Only the first of consecutive offenders: the window of the next one moves with its cut.
        first = bad.view(plans, -1).clone()
        first[:, 1:] &= ~bad.view(plans, -1)[:, :-1]
        at = torch.nonzero(first.flatten()).flatten()
        ahead, ahead_err = _solve_within(seq, k, goal, _at(lo, at), _at(lo + tokens, at), g, at)
        # Or the previous rank moves: between its predecessor's window and this root.
        back = _at(at, torch.nonzero(_at(rank, at) > 0).flatten())
        prev = back - 1
        before = _at(lo, prev)  # rank 0's window starts at 0
        b_lo = torch.maximum(before, _at(x, back) - _at(tokens, back))
        b_hi = torch.minimum(before + _at(tokens, prev), _at(x, back))
        fits = torch.nonzero(b_lo <= b_hi).flatten()
        back, prev = _at(back, fits), _at(prev, fits)
        moved, moved_err = _solve_within(seq, k, goal, _at(b_lo, fits), _at(b_hi, fits), g, prev)
        own_err = (seq.held(_at(x, back), _at(k, back), None if g is None else _at(g, back)) - _at(goal, back)).abs()
        # per offender: its own cut solved again ahead, or kept with the previous rank's moved
        where = torch.searchsorted(at, back)
        use = torch.nonzero(torch.maximum(moved_err, own_err) < _at(ahead_err, where)).flatten()
        kept, old = _at(back, use), x
        x = old.index_copy(0, at, ahead).index_copy(0, kept, _at(old, kept))
        x = x.index_copy(0, _at(prev, use), _at(moved, use))
    # Within each plan (the clamps leave a plan without offenders as it is):
    xx = torch.cummax(x.view(plans, -1), 1).values
    xx = torch.cummin(xx - kk, 1).values + kk
    # The two clamps can undo each other; runs of length in [0, tokens] by construction:
    steps = torch.diff(xx, dim=1, prepend=xx.new_zeros(plans, 1)).clamp(min=0).minimum(tokens.view(plans, -1))
    return torch.cumsum(steps, 1).flatten()


def _solve_within(seq: Sequence, k: torch.Tensor, goal: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  g: torch.Tensor | None, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Front cuts of ``rows`` (of ``k``, ``goal``, ``g``) inside ``[lo, hi]``, and how far their
    held work is from the goal. Inside a window the held work may rise and fall, so the bisection
    starts from the first step of a grid of :data:`REPAIR_GRID` cuts that crosses the goal (or,
    where none does, from the grid's closest cut)."""
    if rows.numel() == 0:
        return lo, goal.new_zeros(0)
    k, goal, g = _at(k, rows), _at(goal, rows), None if g is None else _at(g, rows)
    steps = torch.arange(REPAIR_GRID + 1)
    at = lo[:, None] + (hi - lo)[:, None] * steps // REPAIR_GRID  # [rows, grid + 1], lo and hi included
    wide = at.shape[1]
    held = seq.held(at.flatten(), k.repeat_interleave(wide), None if g is None else g.repeat_interleave(wide))
    off = held.view(at.shape) - goal[:, None]
    crossing = (off[:, :-1] < 0) & (off[:, 1:] >= 0)
    step = torch.where(crossing.any(1), crossing.to(torch.int8).argmax(1), -1)
    closest = off.abs().argmin(1)
    a = at.gather(1, torch.where(step >= 0, step, closest)[:, None]).squeeze(1)
    b = torch.where(step >= 0, at.gather(1, (step + 1).clamp(max=wide - 1)[:, None]).squeeze(1), a)
    x = seq.solve(k, goal, a, b, g)
    return x, (seq.held(x, k, g) - goal).abs()


def _chunks(lengths: torch.Tensor, rank_tokens: int, whole: torch.Tensor, chunking: Chunking
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(doc, start, end, head)`` of every chunk of the documents as ``chunking`` lays them out
    (``head``: the chunks that go last, None without ``head_back``)."""
    chunks_per_rank, head_back = chunking.per_rank, chunking.head_back
    if head_back:  # tail and head: the split document's chunk k = 0 starts at head_back * L
        one, count = whole, torch.where(whole, (lengths > 0).long(), 2)
    else:
        size = max(rank_tokens // chunks_per_rank, 1) if chunks_per_rank else max(int(lengths.max()), 1)
        one = whole | (lengths <= size)  # documents laid out as one chunk
        count = torch.where(one, (lengths > 0).long(), -(-lengths // size))
    doc = repeat(torch.arange(lengths.numel()), count)
    from_end = expand(torch.zeros_like(count), count)  # chunk k of a document, from its end
    doc_len, one = _at(lengths, doc), _at(one, doc)
    if head_back:
        split = (doc_len * head_back).long()
        end = torch.where(one | (from_end == 0), doc_len, split)
        start = torch.where(one | (from_end > 0), 0, split)
    else:  # chunk k ends at L - k * size (the short remainder is the head)
        end = torch.where(one, doc_len, doc_len - from_end * size)
        start = torch.where(one, 0, (end - size).clamp(min=0))
    heads = (~one & (from_end > 0)) if head_back else None  # heads last
    return doc, start, end, heads


class Sequence:
    """The plan's *chunks*, densest first, each reversed, back to back; prefix work in closed form.

    A document that fits one rank (tokens and work) is one chunk: it is never cut unless a cut
    must land in it. A larger document is laid out by the :class:`Chunking`: one chunk, or
    chunks of a fraction of a rank that sort by density on their own (a big document's expensive
    tail leads, its cheap head trails with the light documents), or its tail by density and its
    head at the very back (the ranks that take the tail from the front take the head from the
    back: head and tail on the same ranks, only the middle to receive).

    Chunks may belong to *groups* (the bisection planner's rank groups): each group's chunks are
    one sequence of their own, back to back with the next group's, and ``held``/``solve``/``snap``
    take the group of each query (``g``; None: one group, the whole sequence).
    """

    def __init__(self, doc: torch.Tensor, start: torch.Tensor, end: torch.Tensor, lengths: torch.Tensor,
                 whole: torch.Tensor, mask: Mask, last: torch.Tensor | None = None,
                 group: torch.Tensor | None = None, groups: int = 1, penalty: torch.Tensor | None = None):
        """Chunks ``[start, end)`` of documents ``doc``, ordered by ``group``, then ``last``
        (False first), then density (work per token) descending. ``penalty``: per group, the cost
        of a cut that could be avoided, beyond any KV (default: one plan's tokens)."""
        self.mask = mask
        doc_len = _at(lengths, doc)
        work = mask.row_work(start, end, doc_len)
        order = torch.argsort(work.double() / (end - start).clamp(min=1).double(), descending=True, stable=True)
        for key in (last, group if groups > 1 else None):
            if key is not None:
                order = _at(order, torch.argsort(_at(key, order).to(torch.int32), stable=True))
        self.doc, self.start, self.doc_len = _at(doc, order), _at(start, order), _at(doc_len, order)
        self.whole_ok = _at(whole, self.doc)
        self.last = _at(last, order) if last is not None else torch.zeros(order.numel(), dtype=torch.bool)
        self.lengths = _at(end - start, order)
        self.end = self.start + self.lengths  # where each chunk's reversed run starts in its document
        self.work = _at(work, order)
        self.cu = torch.cat([lengths.new_zeros(1), torch.cumsum(self.lengths, 0)])
        self.cu_work = torch.cat([self.work.new_zeros(1), torch.cumsum(self.work, 0)]).double()
        self.total = int(self.cu[-1])
        self.total_work = float(self.cu_work[-1])
        if penalty is None:
            penalty = torch.full((groups,), float(lengths.sum()), dtype=torch.float64)
        # per chunk
        self.penalty = _at(penalty, _at(group, order)) if group is not None else penalty.expand(order.numel())
        sizes = torch.bincount(group, minlength=groups) if group is not None else doc.new_full((1,), doc.numel())
        self.group_chunks = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])  # chunk bounds of each group
        self.group_cu, self.group_cu_work = _at(self.cu, self.group_chunks), _at(self.cu_work, self.group_chunks)
        self.group_tokens = torch.diff(self.group_cu)

    @classmethod
    def of_layout(cls, lengths: torch.Tensor, mask: Mask, rank_tokens: int, whole: torch.Tensor,
                  chunking: Chunking) -> Sequence:
        """Every document's chunks as the :class:`Chunking` lays them out (one group)."""
        return cls.of_layouts([(chunking, lengths)], lengths, mask, rank_tokens, whole)

    @classmethod
    def of_layouts(cls, layouts: list[tuple[Chunking, torch.Tensor]], lengths: torch.Tensor, mask: Mask,
                   rank_tokens: int, whole: torch.Tensor) -> Sequence:
        """One group per ``(chunking, doc_lengths)``: the documents of ``doc_lengths`` (the layout's
        ``lengths``, with 0 for documents left out) in chunks as the :class:`Chunking` lays them out."""
        columns = [_chunks(doc_lengths, rank_tokens, whole, chunking) for chunking, doc_lengths in layouts]
        doc, start, end = (torch.cat([c[i] for c in columns]) for i in range(3))
        heads = [c[3] for c in columns]
        last = (torch.cat([h if h is not None else torch.zeros(c[0].numel(), dtype=torch.bool)
                           for h, c in zip(heads, columns, strict=True)])
                if any(h is not None for h in heads) else None)
        group = repeat(torch.arange(len(columns)), torch.tensor([c[0].numel() for c in columns]))
        penalty = torch.tensor([float(doc_lengths.sum()) for _, doc_lengths in layouts], dtype=torch.float64)
        return cls(doc, start, end, lengths, whole, mask, last=last, group=group, groups=len(columns), penalty=penalty)

    def _bounds(self, g: torch.Tensor | None) -> tuple:
        """:meth:`group_bounds` of ``g``; None: the whole sequence as one group (scalars)."""
        return (0, self.total, 0.0, self.total_work) if g is None else self.group_bounds(g)

    def group_bounds(self, g: torch.Tensor | None) -> tuple:
        """(token base, tokens, work base, work end) of groups ``g``; None: of every group."""
        if g is None:
            return self.group_cu[:-1], self.group_tokens, self.group_cu_work[:-1], self.group_cu_work[1:]
        return (_at(self.group_cu, g), _at(self.group_tokens, g), _at(self.group_cu_work, g),
                _at(self.group_cu_work[1:], g))

    def locate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence document holding position ``x`` (the last one for ``x = T``) and the offset."""
        i = (torch.searchsorted(self.cu, x, right=True) - 1).clamp(max=self.lengths.numel() - 1)
        return i, x - _at(self.cu, i)

    def prefix_work(self, x: torch.Tensor) -> torch.Tensor:
        """Work of the first ``x`` tokens of the sequence (float64)."""
        i, o = self.locate(x)
        end = _at(self.end, i)
        return _at(self.cu_work, i) + self.mask.row_work(end - o, end, _at(self.doc_len, i)).double()

    def held(self, x: torch.Tensor, k: torch.Tensor, g: torch.Tensor | None = None,
             u: torch.Tensor | None = None) -> torch.Tensor:
        """Work of ranks 0..r (of group ``g``) when their front runs end at ``x`` (and hold ``k``
        tokens in all): the rest from the back, or with ``u``, the *window* ``[u, u + k - x)``."""
        base, tokens, work0, work1 = self._bounds(g)
        if u is None:
            front, back = self.prefix_work(torch.cat([base + x, base + x + tokens - k])).view(2, -1)
            return front - work0 + work1 - back
        front, lo, hi = self.prefix_work(torch.cat([base + x, base + u, base + u + k - x])).view(3, -1)
        return front - work0 + hi - lo

    def solve(self, k: torch.Tensor, goal: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
              g: torch.Tensor | None = None, rising: torch.Tensor | bool = True,
              front: torch.Tensor | None = None) -> torch.Tensor:
        """Front cut ``x`` in ``[lo, hi]`` whose held work is closest to ``goal`` (bisection; the
        held work grows with ``x`` as long as the front is denser than the back; where it falls
        instead, pass ``rising`` False); with ``front``, the start ``u`` of the window that goes
        with that front cut instead. Rows are independent: a row's root is the same whatever
        else is solved with it (solved rows stay put while others take more steps)."""
        rows = max(lo.numel(), 1)
        levels = max(1, min(SOLVE_LEVELS, (SOLVE_POINTS // rows + 1).bit_length() - 1))
        wide = [t.repeat_interleave((1 << levels) - 1) if isinstance(t, torch.Tensor) and t.dim() else t
                for t in (k, g, front)]

        def held(v: torch.Tensor, k, g, front) -> torch.Tensor:
            return self.held(v, k, g) if front is None else self.held(front, k, g, v)

        lo0 = lo
        goal_, rising_ = _column(goal), _column(rising)
        while bool((lo < hi).any()):
            # The midpoints of the next `levels` bisection steps, for every path through them
            # (level l: 2^l brackets per row, node i's halves are 2i and 2i + 1 a level down), held
            # in one call; then the path the values choose, down to its bracket at the last level.
            # A step below the goal takes the upper half; a solved bracket (lo == hi) the lower
            # one, which is itself: a solved row stays put, each row's root its own bisection's.
            at, open_, node_lo, node_hi = [], [], lo[:, None], hi[:, None]
            for _ in range(levels):
                mid = (node_lo + node_hi) // 2
                at.append(mid)
                open_.append(node_lo < node_hi)
                node_lo = torch.stack([node_lo, mid + 1], 2).flatten(1)
                node_hi = torch.stack([mid, node_hi], 2).flatten(1)
            at = torch.cat(at, 1)
            upper = ((held(at.flatten(), *wide).view(at.shape) < goal_) == rising_) & torch.cat(open_, 1)
            node = torch.zeros_like(lo)[:, None]
            for level in range(levels):
                node = 2 * node + upper.gather(1, node + ((1 << level) - 1))
            lo, hi = node_lo.gather(1, node).squeeze(1), node_hi.gather(1, node).squeeze(1)
        prev = torch.maximum(lo - 1, lo0)
        both = held(torch.cat([prev, lo]), *(torch.cat([t, t]) if isinstance(t, torch.Tensor) and t.dim() else t
                                             for t in (k, g, front)))
        closer = (both[:prev.numel()] - goal).abs() < (both[prev.numel():] - goal).abs()
        return torch.where(closer, prev, lo)

    def snap(self, x: torch.Tensor, k: torch.Tensor, goal: torch.Tensor, slack: float,
             g: torch.Tensor | None = None, front: torch.Tensor | None = None) -> torch.Tensor:
        """Move each pair of cuts (``x`` and ``y = x + T - k`` together) so that they cut as few
        documents as possible, least KV next, while the held work stays within ``slack``; with
        ``front``, the two ends of the window that goes with that front cut (``x``: its start)."""
        base, tokens = self._bounds(g)[:2]
        first, last = (0, self.cu.numel() - 1) if g is None else (self.group_chunks[g], self.group_chunks[g + 1])
        lo, hi, offset = (0, k, tokens - k) if front is None else (front, front + tokens - k, k - front)
        y = x + offset
        candidates = [x]
        for cut in (x, y):
            # The group's own chunk (a cut at the group's end is in its last chunk, as it is when
            # the group is alone: the next group's chunks must not move which boundaries are near).
            i = torch.minimum(self.locate(base + cut)[0], torch.as_tensor(last) - 1)
            for j in range(-SNAP_REACH, SNAP_REACH + 2):  # this cut onto a nearby chunk boundary
                near = torch.minimum(torch.maximum(i + j, torch.as_tensor(first)), torch.as_tensor(last))
                candidates.append(x + _at(self.cu, near) - base - cut)
        cands = torch.stack(candidates, 1).maximum(_column(lo)).minimum(_column(hi))
        width = cands.shape[1]
        per_row = None if g is None else g.repeat_interleave(width)
        k_ = k.repeat_interleave(width)
        held = (self.held(cands.flatten(), k_, per_row) if front is None else
                self.held(front.repeat_interleave(width), k_, per_row, cands.flatten()))
        err = (held.view_as(cands.double()) - goal[:, None]).abs()
        ok = err <= slack
        ok[:, 0] = True  # the bisection's own cut is always allowed
        # The cost of the allowed pairs of cuts only (the others score the largest float).
        allowed = torch.nonzero(ok.flatten()).flatten()
        at = cands + _column(base)
        ends = torch.stack([at.flatten(), (at + _column(offset)).flatten()]).index_select(1, allowed)
        score = torch.full((cands.numel(),), torch.finfo(torch.float64).max, dtype=torch.float64)
        score = score.index_copy_(0, allowed, self.cut_cost(ends).sum(0)).view(cands.shape)
        best = torch.argmin(score, 1)
        return cands.gather(1, best[:, None]).squeeze(1)

    def cut_cost(self, cut: torch.Tensor) -> torch.Tensor:
        """A cut at sequence position ``cut`` inside a document: a big penalty when the document
        could stay whole (fits one rank), plus the KV its receiver needs (its prefix before the cut)."""
        i, o = self.locate(cut)
        inside = (o > 0) & (o < _at(self.lengths, i))
        kv = (_at(self.end, i) - o).double()  # reversed chunks: the later part starts there
        penalty = torch.where(_at(self.whole_ok, i), _at(self.penalty, i), 0.0)
        return torch.where(inside, kv + penalty, 0.0)

    def pieces(self, cut: Pieces, ranks: torch.Tensor) -> Pieces:
        """Pieces of the sequence's ranges (``cut_stream`` over the chunks) as document pieces."""
        end = _at(self.end, cut.doc)
        return Pieces(_at(ranks, cut.rank), _at(self.doc, cut.doc), end - cut.end, end - cut.start)
