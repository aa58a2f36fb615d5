"""Planner: every strategy and mask against slow, obviously-right references.

The references work token by token (visibility matrices, owner arrays, per-document loops),
so they share no code with the vectorised planner they check.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from doccp import DocLayout, Mask, plan
from doccp.app import workloads
from doccp.plan import STRATEGIES, TILE, Pieces, Plan

SETTINGS = settings(max_examples=200, deadline=None)

masks = st.one_of(
    st.just(Mask.causal()),
    st.just(Mask.full()),
    st.builds(Mask.sliding_window, st.integers(0, 9), st.integers(0, 4)),
    st.builds(Mask, st.none() | st.integers(0, 9), st.none() | st.integers(0, 9)),
)


@pytest.fixture
def unpolished(monkeypatch):
    """The search's own plans, the polish (:mod:`doccp.plan.polish`) off: for tests that pin which
    of its candidates wins and what that plan receives."""
    monkeypatch.setattr(balanced, "polish", lambda pieces, n, cap: pieces)


@st.composite
def layouts(draw, n: int) -> list[int]:
    """Document lengths that stress the planner: empty streams, zero-length, 1-token,
    shorter-than-2N and one-document (whole-stream) layouts, many short documents (packing
    and spilling), and mixtures of them."""
    kind = draw(st.sampled_from(["mixed", "mixed", "mixed", "many", "whole", "tiny", "empty"]))
    if kind == "empty":
        return draw(st.lists(st.just(0), max_size=3))
    if kind == "whole":
        return [draw(st.integers(1, 12 * n + 5))]
    if kind == "tiny":  # every document shorter than 2N
        return draw(st.lists(st.integers(0, 2 * n - 1), min_size=1, max_size=12))
    if kind == "many":
        return draw(st.lists(st.integers(0, 30), min_size=10, max_size=40))
    length = st.one_of(st.just(0), st.just(1), st.integers(2, max(2, 2 * n - 1)), st.integers(2 * n, 8 * n + 3),
                       st.integers(0, 40))
    return draw(st.lists(length, min_size=1, max_size=10))


@st.composite
def cases(draw):
    n = draw(st.integers(1, 16))
    return draw(layouts(n)), n, draw(masks), draw(st.sampled_from(sorted(STRATEGIES)))


balanced = importlib.import_module("doccp.plan.balanced")
trims = importlib.import_module("doccp.plan.trims")
hosts = importlib.import_module("doccp.plan.hosts")
#: Every variant of the bisection planner (head shares x windows, late heads).
BISECTIONS = [balanced.Chunking(0, head_back, True, window, late)
              for head_back, late in balanced.BISECT_HEAD_BACK for window in balanced.BISECT_WINDOW]


def _whole(layout: DocLayout, n: int, mask: Mask) -> torch.Tensor:
    """Documents that may stay whole (as :func:`doccp.plan.balanced.balanced` decides)."""
    doc_work = mask.pairs(0, layout.lengths, 0, layout.lengths)
    return (layout.lengths <= -(-layout.num_tokens // n)) & (doc_work.double() <= float(doc_work.sum()) / n)


def make(case):
    lengths, n, mask, strategy = case
    layout = DocLayout.from_lengths(lengths)
    return layout, plan(layout, n, mask, strategy)


def owners(p) -> torch.Tensor:
    """Rank holding each stream token (-1 if none), from the plan's indices."""
    owner = torch.full((p.layout.num_tokens,), -1, dtype=torch.int64)
    for r in range(p.world_size):
        owner[p.indices(r)] = r
    return owner


def visibility(mask: Mask, length: int) -> torch.Tensor:
    """``[length, length]`` bool: query i sees key j (brute force over the band definition)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    seen = torch.ones(length, length, dtype=torch.bool)
    if mask.left is not None:
        seen &= j >= i - mask.left
    if mask.right is not None:
        seen &= j <= i + mask.right
    return seen


def brute_force(p):
    """Per-rank work and the set of (dst, src, doc, key) KV tokens each rank must receive."""
    owner = owners(p)
    work = [0] * p.world_size
    needed = set()
    for doc, (a, b) in enumerate(zip(p.layout.cu_seqlens[:-1].tolist(), p.layout.cu_seqlens[1:].tolist(),
                                     strict=True)):
        seen, own = visibility(p.mask, b - a), owner[a:b]
        for r in range(p.world_size):
            mine = own == r
            work[r] += int(seen[mine].sum())
            for key in torch.nonzero(seen[mine].any(0) & ~mine).flatten().tolist():
                needed.add((r, int(own[key]), doc, key))
    return work, needed


def brute_tiles(p, rank: int) -> int:
    """128x128 tiles met by rank's pieces: query tiles from each piece start, key tiles from 0."""
    lengths = p.layout.lengths.tolist()
    tiles = 0
    for doc, start, end in p.pieces(rank):
        seen = visibility(p.mask, lengths[doc])
        for q0 in range(start, end, TILE):
            keys = torch.nonzero(seen[q0:min(q0 + TILE, end)].any(0)).flatten()
            tiles += len({k // TILE for k in keys.tolist()})
    return tiles * TILE * TILE


# -- properties of every plan ------------------------------------------------------------
@SETTINGS
@given(cases())
def test_pieces_partition_the_stream(case):
    layout, p = make(case)
    n, lengths = p.world_size, layout.lengths.tolist()
    everything = torch.cat([p.indices(r) for r in range(n)])
    assert torch.equal(torch.sort(everything).values, torch.arange(layout.num_tokens))  # once each, no padding
    sizes = [p.indices(r).numel() for r in range(n)]
    assert sizes == p.local_sizes and max(sizes) - min(sizes) <= 1
    for r in range(n):
        pieces = p.pieces(r)
        assert all(0 <= start < end <= lengths[doc] for doc, start, end in pieces)
        assert pieces == sorted(pieces)  # ordered by (doc, start)
        touching = [(a, b) for a, b in zip(pieces, pieces[1:], strict=False) if a[0] == b[0] and a[2] == b[1]]
        assert not touching, "touching pieces of one document must be merged"
        idx = p.indices(r)
        expected = [layout.cu_seqlens[d].item() + i for d, s, e in pieces for i in range(s, e)]
        assert idx.tolist() == expected and idx.dtype == torch.int64
        assert torch.equal(p.positions(r), layout.positions()[idx])
        assert torch.equal(p.doc_ids(r), layout.doc_ids()[idx])
        offsets = p.local_offsets(r)
        assert torch.equal(idx[offsets.start], layout.cu_seqlens[offsets.doc] + offsets.end)
    again = plan(layout, n, p.mask, p.strategy)
    assert all(again.pieces(r) == p.pieces(r) for r in range(n))  # deterministic


@settings(max_examples=40, deadline=None)
@given(cases(), st.integers(1, 3), st.randoms(use_true_random=False))
def test_rank_offsets_lay_out_each_rank_in_stream_order(case, k, rng):
    """Plan.rank_offsets against a loop: each rank's entries back to back, pieces in stream order."""
    _, p = make(case)
    s = p.stream_pieces
    sizes = torch.tensor([[rng.randint(0, 5) for _ in range(k)] for _ in range(len(s))], dtype=torch.int64)
    sizes = sizes.reshape(len(s), k)
    filled = [0] * p.world_size
    expected = torch.zeros_like(sizes)
    for piece, rank in enumerate(s.rank.tolist()):
        for e in range(k):
            expected[piece, e] = filled[rank]
            filled[rank] += int(sizes[piece, e])
    assert torch.equal(p.rank_offsets(sizes), expected)
    if k == 1:  # a flat column of one entry per piece
        assert torch.equal(p.rank_offsets(sizes[:, 0]), expected[:, 0])
    local = p.rank_offsets(s.length)  # k = 1 with the pieces' lengths: the local rows
    for r in range(p.world_size):
        mine = s.rank == r
        assert torch.equal(local[mine], torch.cumsum(s.length[mine], 0) - s.length[mine])


@SETTINGS
@given(cases())
def test_exchange_is_the_minimal_kv_exchange(case):
    _, p = make(case)
    _, needed = brute_force(p)
    ex = p.exchange
    rows = list(zip(ex.dst.tolist(), ex.src.tolist(), ex.doc.tolist(), ex.start.tolist(), ex.end.tolist(),
                    strict=True))
    assert rows == sorted(rows) and all(s < e for *_, s, e in rows)
    tokens = [(dst, src, doc, key) for dst, src, doc, s, e in rows for key in range(s, e)]
    assert len(tokens) == len(set(tokens)), "a KV token is received twice"
    assert set(tokens) == needed
    assert ex.tokens_received(p.world_size).tolist() == [sum(t[0] == r for t in needed) for r in range(p.world_size)]


@SETTINGS
@given(cases())
def test_allgather_sends_every_rank_exactly_its_exchange_rows(case):
    """Each rank's all-gather send rows are its rows of the minimal exchange, per peer in (doc,
    start) order: under a causal mask from the ranks holding later parts of each document
    (:func:`~doccp.plan.exchange.prefix_receivers`), under the others from every rank's visible keys."""
    _, p = make(case)
    assert_allgather_sends_its_exchange_rows(p, range(p.world_size))
    if case[2] in (Mask.causal(), Mask.full()):  # the path each takes
        assert p.causal_like == (case[2] == Mask.causal())


def assert_allgather_sends_its_exchange_rows(p: Plan, ranks) -> None:
    """Each of ``ranks`` sends every peer exactly its rows of the minimal exchange, in order, and
    each of them expects from each other as many rows as that one sends it."""
    from doccp.algorithms.registry import schedule_of
    ex = p.exchange
    schedules = {r: schedule_of("allgather", p, r) for r in ranks}
    for src, sched in schedules.items():
        row_of = {int(g): row for row, g in enumerate(p.indices(src).tolist())}
        sent = ex.select(ex.src == src)
        for dst in range(p.world_size):
            rows = sent.select(sent.dst == dst)
            spans = zip(rows.doc.tolist(), rows.start.tolist(), rows.end.tolist(), strict=True)
            expected = [row_of[int(p.layout.cu_seqlens[d]) + k] for d, a, b in spans for k in range(a, b)]
            assert sched.send_rows[dst].tolist() == expected, (src, dst)
        assert sum(sched.recv_sizes) == p.kv_received[src], src
        assert all(schedules[dst].recv_sizes[src] == len(sched.send_rows[dst]) for dst in schedules), src


@SETTINGS
@given(cases())
def test_ring_schedule_under_a_causal_mask_matches_the_general_path(case):
    """Under a causal mask (:attr:`~doccp.plan.Plan.causal_like`) the ring's blocks are every
    piece but each document's last, whole, laid out in rank order, and no slice needs its rows
    trimmed: the same blocks, block rows and slices, step by step (in another order within a
    step), as the path every other mask takes."""
    lengths, n, _, strategy = case
    assert_causal_ring_matches_the_general_path(DocLayout.from_lengths(lengths), n, strategy, range(n))


def assert_causal_ring_matches_the_general_path(layout: DocLayout, n: int, strategy: str, ranks) -> None:
    """The causal ring's blocks and, for each of ``ranks``, its schedule against the general path's."""
    from doccp.algorithms import ring_kv
    from doccp.algorithms.registry import schedule_of
    from doccp.kernels.slices import FIELDS
    fast = plan(layout, n, Mask.causal(), strategy)
    general = Plan(layout, n, Mask.causal(), strategy, fast.stream_pieces)
    general.__dict__["causal_like"] = False  # (a cached property) the path of every other mask
    assert fast.causal_like
    causal, every = ring_kv.ring_blocks(fast), ring_kv.ring_blocks(general)
    assert isinstance(causal, ring_kv.CausalBlocks) and isinstance(every, ring_kv.RingBlocks)
    g0 = layout.cu_seqlens[causal.doc] + causal.start
    owner = torch.repeat_interleave(torch.arange(n), causal.counts)
    assert torch.equal(owner, fast.stream_pieces.rank[causal.index])
    blocks = sorted(zip(owner.tolist(), g0.tolist(), (g0 + causal.length).tolist(), causal.row.tolist(), strict=True))
    assert blocks == sorted(zip(*(x.tolist() for x in every[:4]), strict=True))
    assert torch.equal(causal.sizes, every.sizes)
    for r in ranks:
        got, want = schedule_of("ring_kv", fast, r), schedule_of("ring_kv", general, r)
        assert torch.equal(got.own_block_rows, want.own_block_rows) and got.block_sizes == want.block_sizes
        for t, (a, b) in enumerate(zip(got.step_slices, want.step_slices, strict=True)):
            assert sorted(a.rows()) == sorted(b.rows()), (r, t)
            assert len(a) == len(b) and all(getattr(a, f).dtype == torch.int64 for f in FIELDS)


@pytest.mark.parametrize("n", [64, 257, 1024])
def test_schedules_at_many_ranks(n):
    """The schedules' host tables at the world sizes users run (the spawned tests stop at 8 ranks,
    the property tests at 16): past 256 ranks a rank no longer fits the narrowest sort key, and at
    1024 a rank holds a few tokens. For a few ranks of each plan, the all-gather's send rows are
    its rows of the minimal exchange and its receive sizes what its peers send; the causal ring
    matches the general path; ``stats()`` counts the exchange's KV."""
    layouts = [DocLayout.from_lengths(workloads.layout("sft", 4096, 1) + [0, 1]),
               DocLayout.from_lengths([5, 3 * n + 1, 0, 1, 2 * n - 1])]
    ranks = sorted({0, 1, n // 2, n - 1})
    for layout, strategy in itertools.product(layouts, STRATEGIES):
        for mask in (Mask.causal(), Mask.sliding_window(100)):
            p = plan(layout, n, mask, strategy)
            assert p.stats().kv_recv == p.exchange.tokens_received(n).tolist(), (strategy, mask)
            assert_allgather_sends_its_exchange_rows(p, ranks)
        assert_causal_ring_matches_the_general_path(layout, n, strategy, ranks)


@pytest.mark.skipif(sys.platform != "linux", reason="reads the peak RSS from /proc")
def test_planning_memory_does_not_grow_with_document_length():
    """Planning and stats are O(documents + pieces) in memory, not O(tokens of the largest
    document): a document of 2**31 - 1 tokens (the most a layout holds) over 8 and 64 ranks, every
    strategy, in fresh processes (`bench/plan.py` measures it), grows the peak RSS by far less than
    one byte per token; and the plans are balanced."""
    spec = importlib.util.spec_from_file_location("bench_plan", Path(__file__).parents[1] / "bench" / "plan.py")
    bench_plan = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(bench_plan)
    growth = bench_plan.planning_memory(lengths=[2**31 - 1], world_sizes=[8, 64])
    assert max(growth.values()) < 200, growth
    for n in (8, 64):
        for strategy in ("balanced", "head_tail"):
            s = plan(DocLayout.from_lengths([2**31 - 13, 5, 7]), n, Mask.causal(), strategy).stats()
            assert max(s.tokens) - min(s.tokens) <= 1 and s.imbalance <= 1.01, (n, strategy, s.imbalance)


@pytest.mark.parametrize("batch", [1, 2, 5, 64])
def test_tile_counts_in_bounded_batches_match_one_pass(monkeypatch, batch):
    """Stats count query tiles a bounded batch at a time (a batch may end inside a piece), so a
    document of 2**31 tokens costs no more memory than a short one; the counts must not change."""
    from doccp.app import workloads
    plan_module = importlib.import_module("doccp.plan")
    layout = DocLayout.from_lengths(workloads.layout("pretrain", 32768, 0) + [1, 0, 700])
    plans = [plan(layout, n, mask, s) for n, mask in ((3, Mask.causal()), (4, Mask.sliding_window(300)),
                                                      (5, Mask.chunked(200))) for s in STRATEGIES]
    whole = [p.stats().tile_work for p in plans]
    monkeypatch.setattr(plan_module, "TILE_BATCH", batch)
    assert [p.stats().tile_work for p in plans] == whole


@pytest.mark.parametrize("batch", [1, 2, 3, 7])
def test_plans_built_a_few_entries_at_a_time_match_one_pass(monkeypatch, batch):
    """head_tail's pieces, the stream offsets and the partition check run a bounded span of the
    tables at a time (:data:`doccp.ranges.BATCH`); spans that end inside a document, or between
    two pieces the check compares, must change nothing, and the check must still catch a bad table."""
    ranges = importlib.import_module("doccp.ranges")
    plan_module = importlib.import_module("doccp.plan")
    layouts = [DocLayout.from_lengths(lengths) for lengths in
               ([0, 1, 5, 0, 2, 40, 3, 1], [97], workloads.layout("sft", 4096, 1) + [0, 1])]
    cases = [(layout, n, s) for layout in layouts for n in (1, 3, 8) for s in STRATEGIES]
    whole = [plan(layout, n, Mask.causal(), s) for layout, n, s in cases]
    monkeypatch.setattr(ranges, "BATCH", batch)
    for p, (layout, n, s) in zip(whole, cases, strict=True):
        q = plan(layout, n, Mask.causal(), s)
        columns = [(getattr(p.stream_pieces, f), getattr(q.stream_pieces, f)) for f in ("rank", "doc", "start", "end")]
        assert all(torch.equal(a, b) for a, b in [*columns, *zip(p.stream_bounds, q.stream_bounds, strict=True)])
    # two touching pieces of one document on one rank, on either side of every span boundary
    layout = DocLayout.from_lengths([6, 4])
    split = Plan(layout, 2, Mask.causal(), "test", Pieces.of([0, 1, 1, 0], [0, 0, 0, 1], [0, 2, 4, 0], [2, 4, 6, 4]))
    assert plan_module._partitions(split) and not plan_module._partitions(split, normalized=True)


@pytest.mark.parametrize("batch", [1, 2, 3, 7])
def test_ring_slices_written_a_few_blocks_at_a_time_match_one_pass(monkeypatch, batch):
    """The causal ring's slices are written a batch of blocks at a time (:data:`doccp.ranges.BATCH`
    slices, whole blocks); batches that end between any two blocks, or after a block without
    slices, must change no slice of any step."""
    from doccp.algorithms import ring_kv
    ranges = importlib.import_module("doccp.ranges")
    layouts = [DocLayout.from_lengths(lengths) for lengths in ([0, 1, 5, 0, 2, 40, 3, 1], [97], [0])]
    cases = [(layout, n, s) for layout in layouts for n in (1, 3, 8) for s in STRATEGIES]
    whole = [[ring_kv.RingKV().schedule(plan(layout, n, Mask.causal(), s), r) for r in range(n)]
             for layout, n, s in cases]
    monkeypatch.setattr(ranges, "BATCH", batch)
    for schedules, (layout, n, s) in zip(whole, cases, strict=True):
        p = plan(layout, n, Mask.causal(), s)
        for r, want in enumerate(schedules):
            got = ring_kv.RingKV().schedule(p, r)
            assert torch.equal(got.own_block_rows, want.own_block_rows) and got.block_sizes == want.block_sizes
            assert [a.rows() for a in got.step_slices] == [b.rows() for b in want.step_slices], (layout, n, s, r)


@SETTINGS
@given(cases())
def test_stats_are_consistent(case):
    layout, p = make(case)
    n = p.world_size
    s = p.stats()
    work, needed = brute_force(p)
    assert s.tokens == p.local_sizes and s.num_tokens == layout.num_tokens
    assert s.work == work and s.total_work == sum(work)
    assert s.total_work == sum(int(visibility(p.mask, length).sum()) for length in layout.lengths.tolist())
    assert s.pieces == [len(p.pieces(r)) for r in range(n)]
    assert s.kv_recv == [sum(t[0] == r for t in needed) for r in range(n)]
    assert s.tile_work == [brute_tiles(p, r) for r in range(n)]
    mean = sum(work) / n
    assert s.imbalance == pytest.approx(max(work) / mean if mean else 1.0)
    tile_mean = sum(s.tile_work) / n
    assert s.tile_imbalance == pytest.approx(max(s.tile_work) / tile_mean if tile_mean else 1.0)
    expected_fraction = 0.0 if n == 1 else max(s.kv_recv) / max(layout.num_tokens - min(s.tokens), 1)
    assert s.max_kv_fraction == pytest.approx(expected_fraction)
    table = s.table().splitlines()
    assert len(table) == n + 2 and all(line.split()[:2] == [str(r), str(s.tokens[r])]
                                       for r, line in enumerate(table[1:-1]))


# -- the documented strategies -----------------------------------------------------------
def head_tail_reference(lengths: list[int], n: int) -> list[list[int]]:
    """Head-tail as its docstring states it, one document and one remainder token at a time."""
    per_rank: list[list[int]] = [[] for _ in range(n)]
    cursor = offset = 0
    for length in lengths:
        base, rem = divmod(length, 2 * n)
        head, tail = [base] * n, [base] * n
        for k in range(rem):
            (head if k < n else tail)[(cursor + k) % n] += 1
        cursor = (cursor + rem) % n
        start = offset
        for chunk in range(2 * n):
            rank = chunk if chunk < n else 2 * n - 1 - chunk
            size = head[rank] if chunk < n else tail[rank]
            per_rank[rank].extend(range(start, start + size))
            start += size
        offset += length
    return per_rank


@SETTINGS
@given(st.integers(1, 16).flatmap(lambda n: st.tuples(st.just(n), layouts(n))))
def test_head_tail_matches_its_formula(case):
    n, lengths = case
    p = plan(DocLayout.from_lengths(lengths), n, strategy="head_tail")
    assert [p.indices(r).tolist() for r in range(n)] == head_tail_reference(lengths, n)


@SETTINGS
@given(st.integers(1, 16).flatmap(lambda n: st.tuples(st.just(n), layouts(n))))
def test_head_tail_emits_normalized_pieces(case):
    """head_tail's pieces come out as plan() keeps them (no empty piece, stream order, rank
    N - 1's two middle chunks as one piece), so planning skips the sort and merge."""
    n, lengths = case
    pieces = STRATEGIES["head_tail"](DocLayout.from_lengths(lengths), n, Mask.causal())
    normalized = pieces.stream_normalized()
    assert all(getattr(pieces, f).tolist() == getattr(normalized, f).tolist() for f in ("rank", "doc", "start", "end"))


def test_head_tail_spreads_remainders():
    """Seed 000 gave every remainder token to rank 0; rotating them keeps totals equal."""
    p = plan(DocLayout.from_lengths([5] * 8), 2, strategy="head_tail")
    assert p.local_sizes == [20, 20]
    assert p.pieces(0)[:4] == [(0, 0, 2), (0, 4, 5), (1, 0, 1), (1, 4, 5)]  # doc 1: extra head token to rank 1
    p = plan(DocLayout.from_lengths([7, 7, 7]), 4, strategy="head_tail")  # 7 = 0 * 8 + 7: all remainder
    assert p.local_sizes == [6, 5, 5, 5]


def test_head_tail_matches_pytorch_per_document_balancer():
    """With lengths divisible by 2N, rank r gets what PyTorch's balancer lists for rank r."""
    lb = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    rng = random.Random(0)
    for n in (1, 2, 3, 8):
        lengths = [2 * n * rng.randint(0, 6) for _ in range(7)]
        ours = plan(DocLayout.from_lengths(lengths), n, strategy="head_tail")
        order = lb._PerDocumentHeadTailLoadBalancer([lengths], n, "cpu")._generate_indices()[0]
        theirs = [[] for _ in range(n)]  # PyTorch's order: per document, per rank, head then tail
        for a, length in zip([0, *torch.tensor(lengths).cumsum(0).tolist()], lengths, strict=False):
            for r in range(n):
                theirs[r] += order[a + r * length // n: a + (r + 1) * length // n].tolist()
        assert [ours.indices(r).tolist() for r in range(n)] == theirs


@SETTINGS
@given(st.integers(1, 16).flatmap(lambda n: st.tuples(st.just(n), layouts(n))))
def test_contiguous_is_equal_stream_ranges(case):
    n, lengths = case
    p = plan(DocLayout.from_lengths(lengths), n, strategy="contiguous")
    total = sum(lengths)
    sizes = [total // n + (r < total % n) for r in range(n)]
    bounds = [sum(sizes[:r]) for r in range(n + 1)]
    assert [p.indices(r).tolist() for r in range(n)] == [list(range(bounds[r], bounds[r + 1])) for r in range(n)]


def test_default_is_balanced_causal():
    p = plan(DocLayout.from_lengths([48, 56, 58, 35]), 2)
    assert (p.strategy, p.mask) == ("balanced", Mask.causal())
    assert "balanced" in repr(p) and "world_size=2" in repr(p)


@pytest.mark.parametrize("mix, sigma", [("sft", 0.8), ("pretrain", 1.4)])
def test_balanced_on_realistic_layouts(mix, sigma):
    """The headline claims, on a small seeded mix: balanced work, fewer pieces, less KV."""
    rng = random.Random(sigma)
    for n in (2, 4, 8):
        lengths, total = [], 0
        while total < 32768:
            lengths.append(min(max(1, int(rng.lognormvariate(6.0, sigma))), 32768 - total))
            total += lengths[-1]
        layout = DocLayout.from_lengths(lengths)
        ours, ht = plan(layout, n).stats(), plan(layout, n, strategy="head_tail").stats()
        assert ours.imbalance <= 1.01
        assert max(ours.kv_recv) <= max(ht.kv_recv)
        assert sum(ours.pieces) <= sum(ht.pieces) / 2


# -- bad input ---------------------------------------------------------------------------
LAYOUT = DocLayout.from_lengths([3, 4])


@pytest.mark.parametrize("call, error, match", [
    (lambda: plan(LAYOUT, 0), ValueError, r"world_size must be in \[1, 65536\], got 0"),
    (lambda: plan(LAYOUT, -2), ValueError, r"world_size must be in \[1, "),
    (lambda: plan(LAYOUT, 10**8), ValueError, r"world_size must be in \[1, 65536\]"),
    (lambda: plan(LAYOUT, 2.0), TypeError, "world_size must be an int"),
    (lambda: plan(LAYOUT, True), TypeError, "world_size must be an int"),
    (lambda: plan([3, 4], 2), TypeError, "DocLayout"),
    (lambda: plan(LAYOUT, 2, "causal"), TypeError, "mask must be a doccp.Mask"),
    (lambda: plan(LAYOUT, 2, strategy="zigzag"), ValueError, "strategy must be one of"),
])
def test_bad_plan_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("method", ["pieces", "indices", "positions", "doc_ids", "rank_pieces", "local_offsets"])
def test_rank_out_of_range(method):
    p = plan(LAYOUT, 2)
    for rank, error in [(2, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="rank"):
            getattr(p, method)(rank)


# -- the balanced planner, schedules at the edges, the lower bound ----------------------
def test_readme_example_keeps_short_documents_whole():
    p = plan(DocLayout.from_lengths([300, 40, 1000, 7, 700]), 4)
    holders = {doc: [r for r in range(4) for d, _, _ in p.pieces(r) if d == doc] for doc in range(5)}
    assert all(len(holders[doc]) == 1 for doc in (0, 1, 3)), holders
    s = p.stats()
    assert s.imbalance <= 1.01 and max(p.local_sizes) - min(p.local_sizes) <= 1
    assert s.max_kv_fraction < 0.8  # the planner before v2 received 96.9% of an all-gather here


def test_short_documents_stay_whole_for_a_little_kv_not_for_much_traffic():
    """A plan cutting fewer documents that could stay whole wins within KV_SLACK *and*
    KV_SLACK_TOKENS of the other's max KV; beyond either, the least KV wins."""
    one_cut = (0, 1000, 1, 1.0)
    assert balanced._better((0, 1030, 0, 1.0), one_cut)  # 3%, 30 tokens: kept whole
    assert not balanced._better((0, 1060, 0, 1.0), one_cut)  # 6%: beyond KV_SLACK
    assert balanced._better(one_cut, (0, 1060, 0, 1.0))
    many = (0, 100_000, 1, 1.0)
    assert balanced._better((0, 100_256, 0, 1.0), many)
    assert not balanced._better((0, 100_300, 0, 1.0), many)  # 0.3%, but 300 tokens: the cut wins
    assert balanced._better(many, (0, 100_300, 0, 1.0))
    # Seeded: long #7 over 8 ranks kept two short documents whole at 0.947 of an all-gather; cutting
    # them reaches 0.913, its lower bound (0.034 of an all-gather saved).
    from doccp.plan.bound import kv_lower_bound
    layout = DocLayout.from_lengths(workloads.layouts("long", 131072, 8)[7])
    bound = kv_lower_bound(layout, 8, Mask.causal()) / (layout.num_tokens - layout.num_tokens // 8)
    s = plan(layout, 8).stats()
    assert s.imbalance <= 1.01 and s.max_kv_fraction < bound + 0.001, (s.max_kv_fraction, bound)


MASKS_OF_BALANCE = [Mask.causal(), Mask.full(), Mask.sliding_window(256), Mask.sliding_window(64, 64),
                    Mask.chunked(1024), Mask.chunked(100)]


@pytest.mark.parametrize("mask", MASKS_OF_BALANCE, ids=str)
def test_balanced_for_every_mask_on_seeded_mixes(mask):
    """Balanced work (<= 1.01) and tokens within one for every mask, on the seeded mixes,
    including the heavy-tailed ones (a document may fill most of the pack) and odd N."""
    from doccp.app import workloads
    for mix, n in [("lognormal", 3), ("pareto", 8), ("pretrain", 5), ("sft", 16), ("long", 7)]:
        layout = DocLayout.from_lengths(workloads.layout(mix, 32768, n))
        s = plan(layout, n, mask).stats()
        assert s.imbalance <= 1.01, (mix, n, s.imbalance)
        assert max(s.tokens) - min(s.tokens) <= 1


@pytest.mark.parametrize("mix, world_sizes", [("sft", (2, 4, 8)), ("lognormal", (2, 4, 8))])
def test_balanced_moves_little_more_kv_than_contiguous(mix, world_sizes):
    """Where every document fits a rank, the balanced plan cuts few documents, into runs over
    adjacent ranks: its most-loaded rank receives at most 0.1 of an all-gather more than the
    (unbalanced) contiguous split (the issue's goal is 0.05; bench/plan.py reports it per mix and
    N), and far less than head_tail."""
    from doccp.app import workloads
    for n in world_sizes:
        for index in range(2):
            layout = DocLayout.from_lengths(workloads.layout(mix, 32768, index))
            ours, cont = plan(layout, n).stats(), plan(layout, n, strategy="contiguous").stats()
            assert ours.max_kv_fraction <= cont.max_kv_fraction + 0.1, (n, index)
            assert ours.max_kv_fraction <= 0.25 * plan(layout, n, strategy="head_tail").stats().max_kv_fraction


def test_balanced_cuts_big_documents_into_runs():
    """A document longer than a rank is held as few contiguous runs; the rest stay whole."""
    lengths = [5000, 30, 200, 12, 700, 64]
    p = plan(DocLayout.from_lengths(lengths), 4)
    holders = {doc: {r for r in range(4) for d, _, _ in p.pieces(r) if d == doc} for doc in range(len(lengths))}
    assert all(len(holders[d]) == 1 for d in (1, 3, 5)), holders
    assert p.stats().imbalance <= 1.01


@pytest.mark.parametrize("mask, world_sizes", [(Mask.full(), (3,)), (Mask.sliding_window(256), (3, 8)),
                                               (Mask.sliding_window(64, 64), (3, 8))])
def test_balanced_on_every_mask(mask, world_sizes):
    from doccp.app import workloads
    for n in world_sizes:
        layout = DocLayout.from_lengths(workloads.layout("sft", 16384, n))
        s = plan(layout, n, mask).stats()
        assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1


@pytest.mark.parametrize("lengths, n", [([], 1), ([], 3), ([0, 0], 2), ([1, 0, 1], 3), ([2], 5), ([1], 1)])
def test_schedules_of_empty_ranks(lengths, n):
    """Ranks with no token (T < N) and an empty stream get valid, empty schedules."""
    from doccp.algorithms.registry import schedule_of
    for strategy in STRATEGIES:
        p = plan(DocLayout.from_lengths(lengths), n, strategy=strategy)
        for r in range(n):
            ag, ring = schedule_of("allgather", p, r), schedule_of("ring_kv", p, r)
            assert len(ag.send_rows) == n and len(ag.recv_sizes) == n and len(ring.step_slices) == n
            assert ag.arrange.numel() == p.stats().kv_recv[r] + p.local_sizes[r]
            assert ring.own_block_rows.numel() == ring.block_sizes[r] <= p.local_sizes[r]
            if p.local_sizes[r] == 0:
                assert not any(len(s) for s in ring.step_slices) and not len(ag.slices)


def test_lower_bound_examples():
    from doccp.plan.bound import kv_lower_bound
    assert kv_lower_bound(DocLayout.from_lengths([5, 5]), 1, Mask.causal()) == 0
    assert kv_lower_bound(DocLayout.from_lengths([]), 4, Mask.causal()) == 0
    assert kv_lower_bound(DocLayout.from_lengths([4] * 8), 4, Mask.causal()) == 0  # everything may stay whole
    # One document over 8 ranks: the holder of its last row holds at most T/8 of it.
    assert kv_lower_bound(DocLayout.from_lengths([800]), 8, Mask.causal()) == 700


@pytest.mark.parametrize("mask", [Mask.causal(), Mask.full(), Mask.sliding_window(9, 2), Mask.chunked(7)], ids=str)
def test_lower_bound_is_below_every_balanced_plan(mask):
    """The bound holds for every strategy's plan that is balanced, on small random layouts."""
    from doccp.plan.bound import kv_lower_bound
    rng = random.Random(str(mask))
    for _ in range(30):
        n = rng.randint(2, 4)
        lengths = [rng.randint(1, 30) for _ in range(rng.randint(1, 4))]
        layout = DocLayout.from_lengths(lengths)
        bound = kv_lower_bound(layout, n, mask)
        for strategy in STRATEGIES:
            s = plan(layout, n, mask, strategy).stats()
            if s.imbalance <= 1.01:
                assert max(s.kv_recv) >= bound, (lengths, n, strategy)


def _best_max_kv(lengths: list[int], n: int, mask: Mask, tolerance: float) -> int | None:
    """The least max KV of ANY plan (tokens within one, work max/mean <= tolerance), by trying
    every assignment of tokens to ranks; None when no assignment balances."""
    import itertools
    docs = [(d, i) for d, length in enumerate(lengths) for i in range(length)]
    sees = {}  # per token: the keys (doc, j) it sees, and its work
    for d, i in docs:
        lo, hi = (int(x) for x in mask.visible_keys(torch.tensor([i]), torch.tensor([i + 1]), lengths[d]))
        sees[d, i] = {(d, j) for j in range(lo, hi)}
    mean = sum(len(s) for s in sees.values()) / n
    best = None
    for owners in itertools.product(range(n), repeat=len(docs) - 1):
        owners = (0, *owners)  # ranks are interchangeable: the first token on rank 0
        held = [{t for t, r in zip(docs, owners, strict=True) if r == rank} for rank in range(n)]
        sizes = [len(h) for h in held]
        if max(sizes) - min(sizes) > 1 or max(sum(len(sees[t]) for t in h) for h in held) > tolerance * mean:
            continue
        kv = max(len(set().union(*(sees[t] for t in h)) - h) for h in held)
        best = kv if best is None else min(best, kv)
    return best


@pytest.mark.parametrize("mask", [Mask.causal(), Mask.full(), Mask.sliding_window(3), Mask.chunked(3)], ids=str)
def test_lower_bound_is_below_the_optimum(mask):
    """Against every possible plan of tiny layouts (exhaustive search): the bound never exceeds
    the least max KV any balanced plan achieves, and the balanced planner's plan, when balanced,
    is never below it. The first layouts are ones where the third figure is what reaches the
    optimum (causal), the next two where the fourth is (full mask)."""
    from doccp.plan.bound import _Figures, kv_lower_bound
    rng = random.Random(f"optimum {mask}")
    layouts = [([7, 2], 2), ([6, 3, 1], 2), ([4, 3, 2, 1], 2), ([8], 3), ([7], 4)]
    for _ in range(40):
        n = rng.choice([2, 2, 3])
        lengths = [rng.randint(1, 7) for _ in range(rng.randint(1, 5))][: 9 if n == 2 else 7]
        while sum(lengths) > (10 if n == 2 else 7):
            lengths.pop()
        layouts.append((lengths, n))
    checked = third = fourth = 0
    for lengths, n in layouts:
        layout = DocLayout.from_lengths(lengths)
        for tolerance in (1.0, 1.25):
            best = _best_max_kv(lengths, n, mask, tolerance)
            if best is None:
                continue
            bound = kv_lower_bound(layout, n, mask, tolerance)
            assert bound <= best, (lengths, n, tolerance, bound, best)
            checked += bound > 0
            third += bound == best > _Figures(layout, n, mask, tolerance).largest()
            fourth += bound == best > _without_the_fourth_figure(layout, n, mask, tolerance)
            s = plan(layout, n, mask).stats()
            if s.imbalance <= tolerance:
                assert max(s.kv_recv) >= best, (lengths, n, tolerance)
    assert checked >= 5  # the comparison is not vacuous
    if mask == Mask.causal():
        assert third >= 3
    if mask == Mask.full():
        assert fourth >= 2


def _without_the_fourth_figure(layout: DocLayout, n: int, mask: Mask, tolerance: float = 1.01) -> int:
    from doccp.plan import bound
    chain = bound._Figures._chain_allows
    try:
        bound._Figures._chain_allows = lambda self, length, keys: True
        return bound.kv_lower_bound(layout, n, mask, tolerance)
    finally:
        bound._Figures._chain_allows = chain


def test_fourth_figure_follows_the_holders_of_the_top_rows():
    """The module docstring's example: one document of 12 tokens and 6 of 1 token over 3 ranks.
    If no rank received more than 6 keys, the two holders of the document's top rows would need
    more than two ranks' work, and two ranks cannot hold it all: 7 (6 without the fourth figure).
    The bound holds for every balanced plan of every strategy on layouts of one or two long
    documents among short ones over 2-8 ranks, where the fourth figure raises it most."""
    from doccp.plan.bound import kv_lower_bound
    layout = DocLayout.from_lengths([12] + [1] * 6)
    assert _without_the_fourth_figure(layout, 3, Mask.causal()) == 6
    assert kv_lower_bound(layout, 3, Mask.causal()) == 7
    rng = random.Random("fourth figure")
    raised = checked = 0
    for _ in range(24):
        n = rng.randint(2, 8)
        mask = rng.choice([Mask.causal(), Mask.causal(), Mask.full()])
        lengths = [rng.randint(10, 300)] * rng.randint(1, 2) + [rng.randint(1, rng.choice([3, 20, 60]))
                                                                for _ in range(rng.randint(0, 30))]
        rng.shuffle(lengths)
        layout = DocLayout.from_lengths(lengths)
        bound = kv_lower_bound(layout, n, mask)
        raised += bound > _without_the_fourth_figure(layout, n, mask)
        for strategy in STRATEGIES:
            s = plan(layout, n, mask, strategy).stats()
            if s.imbalance <= 1.01:
                checked += 1
                assert max(s.kv_recv) >= bound, (lengths, n, mask, strategy)
    assert raised >= 6 and checked >= 24


def _without_the_fifth_figure(layout: DocLayout, n: int, mask: Mask, tolerance: float = 1.01) -> int:
    from doccp.plan import bound
    together = bound._Figures.together
    try:
        bound._Figures.together = lambda self, keys: True
        return bound.kv_lower_bound(layout, n, mask, tolerance)
    finally:
        bound._Figures.together = together


#: Layouts where the fifth figure raises the bound, with the least max KV of any plan, solved to
#: optimality by ``bench/optimum.py`` (a mixed-integer program, HiGHS through SciPy; 60-66 tokens,
#: too many for exhaustive search): (lengths, ranks, mask, tolerance, optimum).
SOLVED = [
    ([22, 22, 3, 3, 3, 3, 3], 3, "causal", 1.01, 11),
    ([9, 10, 2, 2, 9, 3, 1, 2, 2, 1, 3, 1, 3, 3, 7, 2], 3, "causal", 1.01, 3),
    ([3, 14, 3, 12, 1, 2, 14, 2, 2, 1, 1, 2, 1, 1, 1], 3, "causal", 1.0, 4),
    ([1, 18, 3, 6, 3, 3, 1, 1, 1, 18, 7], 3, "causal", 1.01, 8),
    ([16, 16, 3, 11, 14], 4, "causal", 1.01, 8),
    ([14, 1, 20, 20, 5], 3, "causal", 1.1, 7),
    ([2, 1, 28, 28, 1], 2, "full", 1.0, 1),
    ([3, 1, 24, 1, 24, 3, 6], 2, "full", 1.0, 3),
    ([10, 1, 3, 2, 1, 2, 1, 10, 3, 3, 10, 5, 8, 1], 4, "causal", 1.01, 4),
]


def test_fifth_figure_weighs_the_heaviest_documents_together():
    """The module docstring's example: over 3 ranks, two documents of 22 tokens and five of 3. Each
    long document's holder fits one cap alone, but two such holders need 8 more rows and only 7 rows
    of the layout cost 1: 8 keys (7 without the fifth figure; the optimum is 11). Where the figure
    raises the bound, the bound stays at most the optimum a solver found, and on the benchmark's
    fine-tuning layouts where it raises the bound most (two documents of about 4k tokens, each 90%
    of a rank's work, over 8 ranks), at most what every balanced plan receives."""
    from doccp.plan.bound import kv_lower_bound
    example = DocLayout.from_lengths([22, 22] + [3] * 5)
    assert _without_the_fifth_figure(example, 3, Mask.causal()) == 7
    assert kv_lower_bound(example, 3, Mask.causal()) == 8
    masks = {"causal": Mask.causal(), "full": Mask.full()}
    for lengths, n, mask, tolerance, optimum in SOLVED:
        layout = DocLayout.from_lengths(lengths)
        bound = kv_lower_bound(layout, n, masks[mask], tolerance)
        assert _without_the_fifth_figure(layout, n, masks[mask], tolerance) < bound <= optimum, (lengths, n, mask)
    for seed in (0, 4):
        layout = DocLayout.from_lengths(workloads.layout("sft", 131072, seed))
        bound = kv_lower_bound(layout, 8, Mask.causal())
        assert bound > 1.1 * _without_the_fifth_figure(layout, 8, Mask.causal())
        for strategy in STRATEGIES:
            s = plan(layout, 8, Mask.causal(), strategy).stats()
            assert s.imbalance > 1.01 or max(s.kv_recv) >= bound, strategy


def test_fifth_figure_counts_a_heavy_documents_rows_once():
    """The holders of two heavy documents fill up with rows of other documents and with the rows of
    each heavy document its own holder lacks, not with all of its rows: its cheapest rows are in
    ``own`` already. Lognormal layout #5 over 8 ranks (documents of 4280 and 4212 tokens, each 85% of
    a rank's work): 62 keys, 32 when those rows counted twice; still at most what every balanced
    plan receives."""
    from doccp.plan.bound import kv_lower_bound
    layout = DocLayout.from_lengths(workloads.layout("lognormal", 131072, 5))
    bound = kv_lower_bound(layout, 8, Mask.causal())
    assert bound == 62 and _without_the_fifth_figure(layout, 8, Mask.causal()) < 32
    for strategy in STRATEGIES:
        s = plan(layout, 8, Mask.causal(), strategy).stats()
        assert s.imbalance > 1.01 or max(s.kv_recv) >= bound, strategy


def _bench_optimum():
    """``bench/optimum.py`` as a module (its integer programs need SciPy, a dev dependency)."""
    pytest.importorskip("scipy")
    spec = importlib.util.spec_from_file_location("bench_optimum", Path(__file__).parents[1] / "bench" / "optimum.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_block_relaxation_is_a_lower_bound():
    """``bench/optimum.py``'s block relaxation claims a bound for every balanced plan, at any block
    size: it is at most the optimum on the layouts solved exactly (:data:`SOLVED`, and tiny ones by
    exhaustive search), causal and full masks. Where a few long documents decide the KV it is far
    above ``doccp.plan.bound``'s and still below the planner's balanced plan: long #6 of the plan
    benchmark over 3 ranks, scaled down 100 times (analytic 244, blocks of 80 rows 345, plan 385).
    At the benchmark's own sizes it is below the planner's plans too (work in pairs, unscaled, let
    the solver prove 55420 keys for long #0 over 2 ranks, whose plan receives 43874)."""
    from doccp.plan.bound import kv_lower_bound
    optimum = _bench_optimum()
    names = {"causal": Mask.causal(), "full": Mask.full()}
    for lengths, n, mask, tolerance, best in SOLVED:
        for block in (4, 8):
            bound, _ = optimum.block_lower_bound(lengths, n, block, mask, tolerance, time_limit=20)
            assert bound is not None and bound <= best, (lengths, n, block, bound, best)
    rng = random.Random("block relaxation")
    checked = 0
    for _ in range(12):
        n, mask = rng.choice([2, 3]), rng.choice(["causal", "full"])
        lengths = [rng.randint(0, 5) for _ in range(rng.randint(1, 4))]
        while sum(lengths) > (9 if n == 2 else 7):
            lengths.pop()
        best = _best_max_kv(lengths, n, names[mask], 1.01) if sum(lengths) else None
        if best is None:
            continue
        for block in (1, 2, 3):
            bound, _ = optimum.block_lower_bound(lengths, n, block, mask, 1.01, time_limit=20)
            assert bound is not None and bound <= best, (lengths, n, mask, block, bound, best)
            checked += bound > 0
    assert checked >= 6
    lengths, n = [14, 4, 675, 12, 607], 3
    layout = DocLayout.from_lengths(lengths)
    analytic = kv_lower_bound(layout, n, Mask.causal())
    bound, solved = optimum.block_lower_bound(lengths, n, 80, time_limit=60)
    s = plan(layout, n).stats()
    assert solved and bound > 1.3 * analytic and s.imbalance <= 1.01 and bound <= max(s.kv_recv), (
        analytic, bound, s.kv_recv)
    for index, n in ((0, 2), (2, 2), (1, 3)):
        lengths = workloads.layout("long", 131072, index)
        s = plan(DocLayout.from_lengths(lengths), n).stats()
        bound, solved = optimum.block_lower_bound(lengths, n, 131072 // (8 * n), time_limit=30)
        assert solved and s.imbalance <= 1.01 and bound is not None, (index, n, bound)
        assert 0.9 * max(s.kv_recv) <= bound <= max(s.kv_recv), (index, n, bound, s.kv_recv)


def test_causal_floor_is_below_the_bound_and_the_optimum():
    """The planner's closed-form floor (the longest document's first two figures, fill at one pair a
    row) never exceeds the lower bound on random layouts, nor the least max KV of any plan of tiny
    ones (exhaustive search), and is exact for one document much longer than a rank."""
    from doccp.plan.bound import causal_floor, kv_lower_bound
    assert causal_floor(DocLayout.from_lengths([800]), 8) == 700
    assert causal_floor(DocLayout.from_lengths([800] + [1] * 224), 8) == 672  # the module docstring's example
    assert causal_floor(DocLayout.from_lengths([5, 5]), 1) == causal_floor(DocLayout.from_lengths([]), 4) == 0
    rng = random.Random("causal floor")
    raised = 0
    for _ in range(200):
        n = rng.randint(2, 9)
        lengths = [rng.randint(0, rng.choice([5, 40, 300])) for _ in range(rng.randint(1, 30))]
        layout = DocLayout.from_lengths(lengths)
        floor = causal_floor(layout, n)
        assert floor <= kv_lower_bound(layout, n, Mask.causal()), (lengths, n)
        raised += floor > 0
    for _ in range(30):
        n = rng.choice([2, 3])
        lengths = [rng.randint(1, 7) for _ in range(rng.randint(1, 3))]
        while sum(lengths) > (9 if n == 2 else 7):
            lengths.pop()
        for tolerance in (1.0, 1.25):
            best = _best_max_kv(lengths, n, Mask.causal(), tolerance)
            if best is not None:
                assert causal_floor(DocLayout.from_lengths(lengths), n, tolerance) <= best, (lengths, n, tolerance)
    assert raised >= 50


def test_balanced_stops_at_a_plan_within_the_slack_of_the_floor(monkeypatch):
    """One document of 20000 tokens among short ones over 16 ranks (32k tokens): the first probe
    receives the floor itself (the holder of the last row holds a rank's tokens), so the search ends
    there, without the recursive bisections that the search tries otherwise for the same KV."""
    from doccp.plan.bound import causal_floor
    lengths = [20000]
    while sum(lengths) < 32768:
        lengths.append(min(len(lengths) * 37 % 600 + 1, 32768 - sum(lengths)))
    layout = DocLayout.from_lengths(lengths)
    bisections = []
    solve = balanced._bisection_plans
    monkeypatch.setattr(balanced, "_bisection_plans", lambda *args: bisections.append(1) or solve(*args))
    stats = plan(layout, 16, Mask.causal()).stats()
    assert max(stats.kv_recv) == causal_floor(layout, 16) == 17952 and stats.imbalance <= 1.01
    assert not bisections
    monkeypatch.setattr(balanced, "causal_floor", lambda *args: 0)  # no floor: the search goes on
    assert max(plan(layout, 16, Mask.causal()).kv_received) == 17952 and bisections


def test_lower_bound_of_one_document_over_two_ranks():
    """The second figure of the bound (module docstring example) gives 36; the third, 41, and the
    balanced planner's head + tail plan receives exactly that: it is optimal here."""
    from doccp.plan.bound import _Figures, kv_lower_bound
    layout = DocLayout.from_lengths([100] + [1] * 100)
    assert _Figures(layout, 2, Mask.causal(), 1.01).largest() == 36
    assert kv_lower_bound(layout, 2, Mask.causal()) == 41
    s = plan(layout, 2).stats()
    assert s.imbalance <= 1.01 and max(s.kv_recv) == 41


def test_lower_bound_counts_the_cheapest_fill():
    """A document that fits a rank by its own tokens and work may still have to be cut: the rank
    must also hold T // N tokens, and no other rows are cheaper than the fill. Over 2 ranks, 4, 3,
    2 and 1 tokens (cap 1.01 * 20 / 2 = 10.1 pairs): the 4-token document costs 10, plus at least
    1 for the fifth token, so it is cut and someone receives a key (first figure). If no rank
    received more than 1 key, the holder of its last row would hold 3 or 4 of its rows and fill up
    with rows the other rank does not receive: more than 10.1 pairs (third figure), so 2, the
    optimum."""
    from doccp.plan.bound import _Figures, kv_lower_bound
    lengths = [4, 3, 2, 1]
    assert _Figures(DocLayout.from_lengths(lengths), 2, Mask.causal(), 1.01).largest() == 1
    assert kv_lower_bound(DocLayout.from_lengths(lengths), 2, Mask.causal()) == 2
    assert _best_max_kv(lengths, 2, Mask.causal(), 1.01) == 2


def test_third_figure_holds_only_rows_the_document_has():
    """The holder of a document's last ``s`` rows can hold at most ``L - s`` more of it. The third
    figure used to let it count up to ``K`` more rows below them even where none are left (the
    whole document held), and so need that much less fill: here 5, now 6 (the balanced planner's
    plan receives 11). The bound still holds for every balanced plan of every strategy on layouts
    of one long document among short ones, where this matters most."""
    from doccp.plan.bound import _Figures, kv_lower_bound
    layout = DocLayout.from_lengths([21, 12, 11, 6, 7, 3, 3, 10, 4])
    assert _Figures(layout, 2, Mask.causal(), 1.01).largest() == 3
    assert kv_lower_bound(layout, 2, Mask.causal()) == 6
    rng = random.Random("phantom rows")
    checked = 0
    for _ in range(30):
        n = rng.choice([2, 2, 3])
        lengths = [rng.randint(20, 80)] + [rng.randint(1, 12) for _ in range(rng.randint(3, 20))]
        layout = DocLayout.from_lengths(lengths)
        bound = kv_lower_bound(layout, n, Mask.causal())
        for strategy in STRATEGIES:
            s = plan(layout, n, Mask.causal(), strategy).stats()
            if s.imbalance <= 1.01:
                assert max(s.kv_recv) >= bound, (lengths, n, strategy)
                checked += 1
    assert checked >= 30


@pytest.mark.parametrize("mask", [Mask.causal(), Mask.full()], ids=str)
def test_third_and_fourth_figures_are_monotone_in_the_keys_allowed(mask):
    """The bound bisects the third and fourth figures over K, which is exact only if allowing more
    keys never turns a feasible K infeasible: checked at every K on random layouts, a third of them
    with a document the fourth figure follows over several ranks."""
    from doccp.plan.bound import _Figures
    rng = random.Random(f"monotone {mask}")
    chains = 0
    for _ in range(40):
        n = rng.randint(2, 5)
        lengths = [rng.choice([1, 2, 5, 9, 30, 80]) for _ in range(rng.randint(1, 12))]
        figures = _Figures(DocLayout.from_lengths(lengths), n, mask, rng.choice([1.0, 1.01, 1.2]))
        allowed = [figures.allow(k) for k in range(sum(lengths) + 1)]
        assert allowed == sorted(allowed), (lengths, n)
        chains += any(figures._fewest_holders(length) >= 2 for length in set(lengths))
    assert chains >= 13


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 400), min_size=1, max_size=40), st.integers(2, 6), st.sampled_from([0.1, 0.35, 0.5]),
       st.integers(0, 3), st.sampled_from([None, 0.5, 1.0]), st.booleans())
def test_packing_pins_what_fits_and_holds_back_the_lightest_documents(lengths, n, reserve, hosts, taken, matched):
    """The packing pins only documents that can stay whole, outside the reserve (the lightest
    documents holding at most ``reserve`` of the tokens), and never beyond a rank's share of the
    tokens or of the work, less, on the first ``hosts`` ranks, an equal part of the documents too big
    to stay whole, and less what parts pinned already hold (``taken``: that share of rank 0's tokens
    and work): the sequence is left a feasible rest to share out, matched to the reserve's density
    or not. Passes are shared between reserves: each share's pins are those it gets alone."""
    from doccp.plan.pieces import even_sizes
    layout = DocLayout.from_lengths(lengths)
    if layout.num_tokens == 0:
        return
    doc_work = Mask.causal().pairs(0, layout.lengths, 0, layout.lengths)
    whole = (layout.lengths <= -(-layout.num_tokens // n)) & (doc_work.double() <= float(doc_work.sum()) / n)
    hosts = min(hosts, n)
    first = torch.arange(n) == 0
    held_tokens = first * int(even_sizes(layout.num_tokens, n)[0] * (taken or 0))
    held_work = first * (float(doc_work.sum()) / n * (taken or 0))
    held_parts = (held_tokens, held_work.double()) if taken is not None else None
    pinned = balanced._packings(layout.lengths, doc_work, n, whole, (reserve,), hosts, held_parts, matched)[reserve]
    assert bool((balanced._packings(layout.lengths, doc_work, n, whole, (0.1, 0.35, 0.5), hosts, held_parts,
                                    matched)[reserve] == pinned).all())
    held = pinned >= 0
    assert bool((whole | ~held).all())
    tokens = torch.zeros(n, dtype=torch.int64).index_add_(0, pinned[held], layout.lengths[held])
    work = torch.zeros(n, dtype=torch.float64).index_add_(0, pinned[held], doc_work[held].double())
    hosting = torch.arange(n) < hosts
    big_tokens, big_work = int(layout.lengths[~whole].sum()), float(doc_work[~whole].sum())
    room = (even_sizes(layout.num_tokens, n) - hosting * (big_tokens // max(hosts, 1)) - held_tokens).clamp(min=0)
    assert bool((tokens <= room).all())
    work_room = float(doc_work.sum()) / n - hosting * (big_work / max(hosts, 1)) - held_work
    assert bool((work <= work_room.clamp(min=0) + 1e-6).all())
    if taken == 1.0:
        assert not bool((pinned == 0).any())  # rank 0 is full
    heaviest = sorted(range(len(lengths)), key=lambda d: -int(doc_work[d]))  # stable
    lighter = list(itertools.accumulate(lengths[d] for d in reversed(heaviest)))[::-1]
    reserved = [d for d, tokens in zip(heaviest, lighter, strict=True) if tokens <= reserve * layout.num_tokens]
    if reserved:
        assert not bool(held[reserved].any())


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=30), st.integers(2, 16))
@example([37, 5, 64, 22], 2)  # 64 tokens per rank: per_rank 64, 256 and 1024 all cut 1-token chunks
@example([5, 9, 3], 2)  # every document whole: one layout
def test_distinct_chunkings_lay_out_every_chunking_once(lengths, n):
    """The search solves each :data:`CHUNKS_PER_RANK` chunking's sequence once: every chunking lays
    out its chunks exactly as one kept chunking does, and no two kept chunkings lay them out alike
    (first of each kept, in order)."""
    layout = DocLayout.from_lengths(lengths)
    doc_work = Mask.causal().pairs(0, layout.lengths, 0, layout.lengths)
    rank_tokens = max(-(-layout.num_tokens // n), 1)
    whole = (layout.lengths <= rank_tokens) & (doc_work.double() <= float(doc_work.sum()) / n)

    def chunks(per_rank: int) -> tuple:
        return tuple(tuple(c.tolist()) for c in balanced._chunks(layout.lengths, rank_tokens, whole,
                                                                 balanced.Chunking(per_rank))[:3])

    kept = [c.per_rank for c in balanced._distinct_chunkings(layout.lengths, whole, rank_tokens)]
    layouts = {per_rank: chunks(per_rank) for per_rank in balanced.CHUNKS_PER_RANK}
    assert len({layouts[k] for k in kept}) == len(kept)
    assert {layouts[k] for k in kept} == set(layouts.values())
    assert kept == [k for k in balanced.CHUNKS_PER_RANK if layouts[k] not in
                    {layouts[j] for j in balanced.CHUNKS_PER_RANK[:balanced.CHUNKS_PER_RANK.index(k)]}]


def test_plans_scored_in_one_pass_get_their_own_scores(monkeypatch):
    """The search scores its candidates in one pass (each plan's ranks apart): every plan gets the
    score and cut pieces it gets alone, also when the sort key's range splits the pass; and a
    plan's score is its stats (imbalance, max KV received) and the whole-able documents it cuts."""
    rng = random.Random("scores")
    for _ in range(40):
        n = rng.randint(2, 6)
        layout = DocLayout.from_lengths([rng.choice([0, 1, 3, 17, 60, 200]) for _ in range(rng.randint(1, 10))])
        if layout.num_tokens == 0:
            continue
        mask = rng.choice([Mask.causal(), Mask.full(), Mask.sliding_window(4)])
        lengths, work = layout.lengths, mask.row_work(0, layout.lengths, layout.lengths)
        whole = (lengths <= -(-layout.num_tokens // n)) & (work.double() <= float(work.sum()) / n)
        plans = [plan(layout, n, mask, s) for s in STRATEGIES]
        alone = [balanced._scores([p.stream_pieces], layout, n, mask, whole)[0] for p in plans]
        for p, (score, cut) in zip(plans, alone, strict=True):
            stats, pieces = p.stats(), p.stream_pieces
            cut_docs = {d for d, s, e in zip(pieces.doc.tolist(), pieces.start.tolist(), pieces.end.tolist(),
                                              strict=True) if bool(whole[d]) and e - s < int(lengths[d])}
            spread = max(stats.work) / max(stats.total_work / n, 1.0)  # (a mean below one pair counts as one)
            assert score[1:] == pytest.approx((max(stats.kv_recv), len(cut_docs), spread))
            assert torch.equal(cut, whole[pieces.doc] & (pieces.length < lengths[pieces.doc]))
        for limit in (balanced.SCORE_KEY_LIMIT, n * (layout.num_docs + 1) * (int(lengths.max()) + 2) * 2):
            monkeypatch.setattr(balanced, "SCORE_KEY_LIMIT", limit)  # all at once; two at a time
            together = balanced._scores([p.stream_pieces for p in plans], layout, n, mask, whole)
            assert [s for s, _ in together] == [s for s, _ in alone]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(together, alone, strict=True))


def test_matched_packing_leaves_every_rank_the_reserves_density(monkeypatch, unpolished):
    """Packed most-work-first, some ranks are left many tokens to fill with little work and others
    the reverse (sft, 4 ranks, layout 3: 48 to 10,891 work per token needed of a reserve of 98),
    which no share of one reserve fills. Matched, each rank is left needing about the reserve's own
    work per token, and the sequence then cuts almost nothing (KV 0.0068 -> under 0.001 of an
    all-gather)."""
    from doccp.plan.pieces import even_sizes

    def needed(layout: DocLayout, matched: bool) -> tuple[float, float]:
        """Max/min over ranks of the work per token left to fill, and its ratio to the reserve's."""
        lengths, n = layout.lengths, 4
        doc_work = Mask.causal().row_work(0, lengths, lengths)
        whole = _whole(layout, n, Mask.causal())
        pins = balanced._packings(lengths, doc_work, n, whole, (0.1,), matched=matched)[0.1]
        held = pins >= 0
        tokens = even_sizes(layout.num_tokens, n) - torch.zeros(n, dtype=torch.int64).index_add_(
            0, pins[held], lengths[held])
        work = float(doc_work.sum()) / n - torch.zeros(n, dtype=torch.float64).index_add_(
            0, pins[held], doc_work[held].double())
        density = work / tokens
        reserve = float(doc_work[~held].sum()) / float(lengths[~held].sum())
        return float(density.max() / density.min()), float(density.max()) / reserve

    for index in range(8):
        layout = DocLayout.from_lengths(workloads.layout("sft", 131072, index))
        (spread, worst), (matched_spread, matched_worst) = needed(layout, False), needed(layout, True)
        assert matched_spread < spread and matched_spread <= 3.0 and matched_worst <= min(worst, 3.0), index
    layout = DocLayout.from_lengths(workloads.layout("sft", 131072, 3))
    assert plan(layout, 4).stats().max_kv_fraction <= 0.001
    monkeypatch.setattr(balanced, "MATCH_RANKS", 0)
    monkeypatch.setattr(trims, "TRIM_RANKS", 0)  # (it packs this layout whole by itself)
    assert plan(layout, 4).stats().max_kv_fraction == pytest.approx(0.0068, abs=0.0005)


def test_costlier_candidates_run_while_the_plan_receives_much(monkeypatch):
    """The head-at-back, bisection and nested candidates run while the best plan receives more than
    KV_BIG_FEW (0.05) of an all-gather and KV_BIG_FEW_TOKENS over few ranks, even within KV_GOAL of
    the contiguous split's: pretrain over 4 ranks, 131k tokens, layout 5, receives 0.163 of one when
    they stop at KV_HEAVY (a quarter) and under 0.1 now, balanced. In a small batch the same share is
    few tokens, and they stop at KV_BIG_FEW_TOKENS: pareto over 8 ranks, 32k tokens, layout 2, keeps
    0.071 (2043 tokens), where they would find 0.049."""
    layout = DocLayout.from_lengths(workloads.layout("pretrain", 131072, 5))
    contiguous = plan(layout, 4, Mask.causal(), "contiguous").stats().max_kv_fraction
    s = plan(layout, 4).stats()
    assert s.imbalance <= 1.01 and s.max_kv_fraction < 0.1
    small = DocLayout.from_lengths(workloads.layout("pareto", 32768, 2))
    # (the plans packed around nested parts run whatever the best plan receives: 0.048 here)
    monkeypatch.setattr(balanced, "_packed_around_nested", lambda *args: [])
    bisections = []
    bisect = balanced._bisection_plans
    monkeypatch.setattr(balanced, "_bisection_plans", lambda *a, **k: bisections.append(1) or bisect(*a, **k))
    kept = plan(small, 8).stats().max_kv_fraction
    allgather = small.num_tokens - small.num_tokens // 8
    assert kept > balanced.KV_BIG_FEW and kept * allgather < balanced.KV_BIG_FEW_TOKENS and not bisections
    monkeypatch.setattr(balanced, "KV_BIG_FEW", balanced.KV_HEAVY)
    stopped = plan(layout, 4).stats().max_kv_fraction
    assert 0.15 < stopped < contiguous + balanced.KV_GOAL
    monkeypatch.setattr(balanced, "KV_BIG_FEW", 0.05)
    monkeypatch.setattr(balanced, "KV_BIG_FEW_TOKENS", 0)
    bisections.clear()
    assert plan(small, 8).stats().max_kv_fraction < kept - 0.02 and bisections


def test_two_ranks_cut_one_document_next_to_chosen_whole_ones(monkeypatch):
    """With two ranks (causal), one document's head and tail on one rank and its middle on the
    other, next to whole documents a local search picks (doccp.plan.two_ranks): long mix #3 (a
    document of 72k tokens over ranks of 65k) receives 0.449 of an all-gather, not 0.500, by
    putting a dense 23k-token document whole beside a shorter head and tail; pretrain #1 (every
    document could stay whole) 0.038, not 0.098, by cutting one near its start."""
    for mix, index, kv, before in (("long", 3, 0.449, 0.49), ("pretrain", 1, 0.04, 0.09)):
        layout = DocLayout.from_lengths(workloads.layout(mix, 131072, index))
        s = plan(layout, 2).stats()
        assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1 and s.max_kv_fraction <= kv, mix
        with monkeypatch.context() as m:
            m.setattr(balanced, "TWO_RANKS_KV", float("inf"))
            m.setattr(trims, "TRIM_RANKS", 0)  # (pretrain #1: its runs find 0.041 too)
            m.setattr(hosts, "HOST_SHARES", ())  # (and hosting 0.070)
            assert plan(layout, 2).stats().max_kv_fraction > before, mix
    layout = DocLayout.from_lengths(workloads.layout("long", 131072, 3))
    p = plan(layout, 2).stream_pieces
    cut = p.select(p.length < layout.lengths[p.doc])
    assert cut.doc.unique().numel() == 1 and len(cut) == 3  # one document: a head, a tail, a middle
    top = int(cut.rank[cut.end == layout.lengths[cut.doc]][0])
    assert set(cut.rank[cut.start == 0].tolist()) == {top}  # the head is with the tail


@pytest.mark.parametrize("seed", range(40))
def test_two_rank_plans_tile_and_balance(seed):
    """Every plan of doccp.plan.two_ranks is exact for any layout it takes (zero-length, 1-token
    and must-cut documents): the pieces tile every document, rank 0 holds its even share of the
    tokens, at most one document is cut (into a head and a tail on one rank, the middle on the
    other), and the causal work is balanced within the planner's tolerance."""
    from doccp.plan.pieces import even_sizes
    from doccp.plan.two_ranks import two_rank_plans
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 5, 13, 40, 100, 400, 2000]) for _ in range(rng.randint(1, 14))]
    layout = DocLayout.from_lengths(lengths)
    if layout.num_tokens < 2:
        return
    work = Mask.causal().row_work(0, layout.lengths, layout.lengths)
    share = -(-layout.num_tokens // 2)
    whole = (layout.lengths <= share) & (work.double() <= float(work.sum()) / 2)
    plans = two_rank_plans(layout.lengths, work, whole, int(even_sizes(layout.num_tokens, 2)[0]))
    for p in plans:
        held = torch.zeros(layout.num_tokens, dtype=torch.int64)
        for r, d, a, b in zip(*(c.tolist() for c in (p.rank, p.doc, p.start, p.end)), strict=True):
            held[int(layout.cu_seqlens[d]) + a:int(layout.cu_seqlens[d]) + b] += 1
            assert 0 <= a < b <= lengths[d] and r in (0, 1)
        assert bool((held == 1).all())
        assert int(p.length[p.rank == 0].sum()) == int(even_sizes(layout.num_tokens, 2)[0])
        cut = p.select(p.length < layout.lengths[p.doc])
        assert cut.doc.unique().numel() <= 1 and len(cut) <= 3
        ranks = Mask.causal().row_work(p.start, p.end, layout.lengths[p.doc]).double()
        per_rank = torch.zeros(2, dtype=torch.float64).index_add_(0, p.rank, ranks)
        assert float(per_rank.max()) <= 1.01 * float(per_rank.mean()) + float(layout.lengths.max())
    if not bool(whole[layout.lengths > 0].all()) and (~whole).sum() == 1 and layout.num_docs == 1:
        assert len(plans) == 1  # one document alone over two ranks: its head and tail and middle


def _assert_tiles_and_balances(p: Pieces, layout: DocLayout, n: int, mask: Mask) -> None:
    """The pieces tile every document once, every rank holds its even share of the tokens and at most
    1.01 of the mean work."""
    from doccp.plan.pieces import even_sizes
    lengths = layout.lengths.tolist()
    held = torch.zeros(layout.num_tokens, dtype=torch.int64)
    for d, a, b in zip(p.doc.tolist(), p.start.tolist(), p.end.tolist(), strict=True):
        assert 0 <= a < b <= lengths[d]
        held[int(layout.cu_seqlens[d]) + a:int(layout.cu_seqlens[d]) + b] += 1
    assert bool((held == 1).all()), (lengths, n)
    tokens = torch.zeros(n, dtype=torch.int64).index_add_(0, p.rank, p.length)
    assert torch.equal(tokens, even_sizes(layout.num_tokens, n)), (lengths, n)
    work = mask.row_work(0, layout.lengths, layout.lengths)
    per_rank = torch.zeros(n, dtype=torch.float64).index_add_(
        0, p.rank, mask.row_work(p.start, p.end, layout.lengths[p.doc]).double())
    assert float(per_rank.max()) <= 1.01 * float(work.sum()) / n + 1e-6, (lengths, n, str(mask))


def test_trimmed_packings_tile_and_balance():
    """Every plan of doccp.plan.trims is exact for any layout it takes (zero-length and 1-token
    documents, N 2-16, causal, sliding-window and chunked masks): the pieces tile every document once,
    every rank holds its even share of the tokens and at most the tolerance's work, and the only
    documents cut are the runs' (at most one per over-worked rank a round) and those cut into the
    rooms left (at most N - 1 cuts), besides the heads cut off beforehand (at most
    the most per rank of HEADS, times N - 1)."""
    rng, planned, cut_plans, middles, headed = random.Random(0), 0, 0, 0, 0
    for _ in range(120):
        n = rng.randint(2, 16)
        lengths = [rng.choice([0, 1, 2, 5, 13, 40, 100, 200]) for _ in range(rng.randint(30, 160))]
        mask = rng.choice([Mask.causal(), Mask.sliding_window(7), Mask.chunked(32)])
        layout = DocLayout.from_lengths(lengths)
        work = mask.row_work(0, layout.lengths, layout.lengths)
        plans = [p for heads in (False, True)
                 for p in trims.trimmed_packings(layout.lengths, work, n, mask, 1.01, heads=heads)]
        planned += bool(plans)
        for p in plans:
            _assert_tiles_and_balances(p, layout, n, mask)
            cut = torch.unique(p.doc[p.length < layout.lengths[p.doc]]).numel()
            assert cut <= trims.ROUNDS * n + n - 1 + max(k for _, k in trims.HEADS) * (n - 1)
            cut_plans += cut > 0
            middles += bool(((p.start > 0) & (p.end < layout.lengths[p.doc])).any())  # a run after a head
            headed += bool(((p.start == 0) & (p.end == 8) & (layout.lengths[p.doc] > 32)).any())  # heads of 8
    # (what the layouts exercise: 56, 61, 32, 37)
    assert planned >= 40 and cut_plans >= 30 and middles >= 16 and headed >= 20


def test_balanced_trims_the_heaviest_documents_where_ranks_share_many(monkeypatch):
    """sft mix, layout 7, 8 ranks: a 3882-token document does 87% of a rank's work. The sequence
    plans cut a dense document at every rank boundary of their front run, and the rank holding its
    last rows receives the rest (0.025 of an all-gather); packed by density with a run cut off the
    heaviest document after a head about as long (head and tail on one rank, the run on another),
    every rank receives under 0.0045; hosted whole (doccp.plan.hosts), under 0.0015."""
    layout = DocLayout.from_lengths(workloads.layout("sft", 131072, 7))
    heaviest = int(torch.argmax(layout.lengths))
    s = plan(layout, 8).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1 and s.max_kv_fraction <= 0.0015
    p = plan(layout, 8).stream_pieces
    assert len(p.select(p.doc == heaviest)) == 1
    monkeypatch.setattr(hosts, "HOST_SHARES", ())
    s = plan(layout, 8).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1 and s.max_kv_fraction <= 0.0045
    p = plan(layout, 8).stream_pieces
    mine = p.select(p.doc == heaviest)
    assert len(mine) == 3 and int(mine.rank[0]) == int(mine.rank[2]) != int(mine.rank[1])  # head + tail, run
    assert 0.5 <= int(mine.length[0]) / int(mine.length[1]) <= 2  # the head about as long as the run
    monkeypatch.setattr(trims, "TRIM_RANKS", 0)
    assert plan(layout, 8).stats().max_kv_fraction > 0.02


def test_balanced_cuts_heads_where_light_documents_are_too_few(monkeypatch, unpolished):
    """pretrain mix, layout 3, 4 ranks: 63 documents, the longest of 12.5k tokens. Whole documents
    and runs leave a rank short of cheap fill (0.023 of an all-gather); with the first 64 rows cut
    off some of the longest documents beforehand, the heads fill it, and no rank receives more than
    0.005 (each rest's holder receives its head's 64 keys, spread over the ranks)."""
    layout = DocLayout.from_lengths(workloads.layout("pretrain", 131072, 3))
    p = plan(layout, 4)
    s = p.stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1 and s.max_kv_fraction <= 0.005
    pieces = p.stream_pieces
    heads = pieces.select((pieces.start == 0) & (pieces.end == 64) & (pieces.length < layout.lengths[pieces.doc]))
    rests = {(int(d), int(r)) for d, r, a in zip(pieces.doc, pieces.rank, pieces.start, strict=True) if int(a) == 64}
    apart = [int(d) for d, r in zip(heads.doc, heads.rank, strict=True) if (int(d), int(r)) not in rests]
    assert len(apart) >= 12  # heads away from their rests
    monkeypatch.setattr(trims, "HEADS", ())
    assert plan(layout, 4).stats().max_kv_fraction > 0.02


def test_heads_come_off_the_longest_documents_the_runs_leave():
    """Heads come off the ``per_rank * (N - 1)`` longest documents lighter than HEAD_WORK of a rank's
    work and longer than 4 heads, and stay cut off while a run grows on the heaviest."""
    lengths = torch.tensor([250, 40, 90, 33, 150, 80, 60, 2, 0, 35] + [20] * 12)
    work = Mask.causal().row_work(0, lengths, lengths)
    packing = trims.Packing(lengths, work, 3, Mask.causal(), 1.01)
    assert float(work[4]) > trims.HEAD_WORK * packing.mean > float(work[2])  # 150 and 250 are too heavy
    assert packing.heads(8, 1) == {2: (0, 8), 5: (0, 8)}  # 2 ranks but one: 90, 80
    assert packing.heads(8, 4) == {d: (0, 8) for d in (2, 5, 6, 1, 9, 3)}  # every light one longer than 32
    assert packing.heads(64, 4) == {}  # none longer than 256
    heads = packing.heads(8, 4)
    p = packing.solve(1.0, heads)
    across = {int(d) for d, a, b in zip(p.doc, p.start, p.end, strict=True) if int(a) < 8 < int(b)}
    assert not across & set(heads)  # every head cut off at row 8
    assert bool(((p.doc == 0) & (p.start > 0) & (p.end < 250)).any())  # the heaviest's run
    assert packing.solve(1.0, {0: (0, 8)}) is None  # with a head, the heaviest grows no run: nothing sheds enough


def test_trimmed_packing_grows_the_shortest_run_that_sheds_the_excess():
    """A run sheds the work asked of it beyond the run it grows from, as short as that allows,
    ``start`` run lengths into the document (causal, 100 tokens: rows cost 1..100)."""
    lengths = torch.tensor([100, 7])
    work = Mask.causal().row_work(0, lengths, lengths)
    packing = trims.Packing(lengths, work, 2, Mask.causal(), 1.01)
    assert packing.grown(0, None, 1000, 0) == (0, 45)  # 45 * 46 / 2 = 1035 >= 1000 > 990
    assert packing.grown(0, None, 1000, 1) == (26, 52)  # rows 26..51 cost 27..52: 1027
    assert packing.grown(0, None, 1000, 2) == (40, 60)  # rows 40..59 cost 41..60: 1010 (19 rows: 912)
    assert packing.grown(0, (10, 20), 1000, 0) == (0, 48)  # 1176 - 155 (the old run's) >= 1000
    assert packing.grown(0, (26, 52), 500, 1) == (32, 64)  # 1027 + 500: rows 32..63 cost 1552; the
    # new run need not contain the old (the next packing places both parts afresh)
    assert packing.grown(0, None, 10**6, 0) == (1, 100)  # no run sheds it: all but the first row


def test_trimmed_packings_only_where_a_run_per_document_fits():
    """No plans for a mask that looks ahead (a cut then costs both sides), for more than
    TRIM_RANKS ranks, or where a document is longer than a rank's share; one plan, every document
    whole, where the packing balances without runs."""
    def plans(lengths, n, mask=Mask.causal()):
        lengths = torch.tensor(lengths)
        return trims.trimmed_packings(lengths, mask.row_work(0, lengths, lengths), n, mask, 1.01)

    many = [5, 13, 40, 100] * 20  # 3160 tokens
    assert plans(many, 4, Mask.full()) == [] and plans(many, trims.TRIM_RANKS + 1) == []
    assert plans([500, *many], 8) == [] and plans([], 4) == []  # (8 ranks of 457 tokens)
    (whole,) = plans(many, 4)
    assert bool((whole.length == torch.tensor(many)[whole.doc]).all())


def test_hosted_packings_tile_and_balance():
    """Every plan of doccp.plan.hosts is exact for any layout it takes (zero-length and 1-token
    documents, N 2-8, causal, sliding-window and chunked masks, one or two documents of 80-95% of a
    rank's work): the pieces tile every document once, every rank holds its even share of the tokens
    and at most the tolerance's work; the first ranks each hold one heavy document whole, and hold
    besides only whole documents and heads (first rows); every other rank holds whole documents and
    rests (a document's rows after its head), and under a causal mask receives exactly its rests'
    heads."""
    rng, planned = random.Random(1), 0
    for _ in range(60):
        n = rng.randint(2, 8)
        small = [rng.choice([0, 1, 2, 5, 13, 40, 100, 200]) for _ in range(rng.randint(40, 80) * n)]
        mask = rng.choice([Mask.causal(), Mask.causal(), Mask.sliding_window(300), Mask.chunked(512)])
        k, share = rng.randint(1, min(2, n - 1)), rng.uniform(0.8, 0.95)
        cost = lambda length, mask=mask: float(mask.row_work(0, torch.tensor([length]), torch.tensor([length]))[0])  # noqa: E731
        rest, lo, hi = sum(cost(length) for length in small if length), 1, sum(small) // n
        while lo < hi:  # the length whose work is ``share`` of a rank's
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= share * (rest + k * cost(mid)) / n else (lo, mid - 1)
        lengths = small + [lo] * k
        rng.shuffle(lengths)
        layout = DocLayout.from_lengths(lengths)
        work = mask.row_work(0, layout.lengths, layout.lengths)
        plans = hosts.hosted_packings(layout.lengths, work, n, mask, 1.01)
        planned += bool(plans)
        for p in plans:
            _assert_tiles_and_balances(p, layout, n, mask)
            whole = p.length == layout.lengths[p.doc]
            heavy = whole & (layout.lengths[p.doc] == lo)
            h = int(heavy.sum())
            assert 1 <= h <= k and torch.equal(torch.sort(p.rank[heavy]).values, torch.arange(h))  # the first ranks
            on_hosts, others = p.rank < h, p.rank >= h
            assert bool((whole | (p.start == 0) | (p.end < layout.lengths[p.doc]))[on_hosts].all())  # heads
            assert bool((whole | (p.end == layout.lengths[p.doc]))[others].all())  # rests
            assert bool((~whole & others).any())  # the others give heads
            if mask == Mask.causal():
                kv = Plan(layout, n, mask, "balanced", p.stream_normalized()).stats().kv_recv
                rests = torch.zeros(n, dtype=torch.int64).index_add_(0, p.rank[others], p.start[others])
                assert kv[h:] == rests[h:].tolist(), (lengths, n)
    # (what the layouts exercise: 20)
    assert planned >= 15, planned


def test_even_heads_share_the_rows_out_evenly():
    """A rank's excess comes off its documents as even heads, each keeping a row at least; too few
    rows to give fails the attempt."""
    assert hosts._even_heads(10, [5, 5, 5]) == [4, 3, 3]
    assert hosts._even_heads(10, [2, 30, 30]) == [1, 5, 4]  # the 2-token one gives its one row, the rest share
    assert hosts._even_heads(0, [7, 1]) == [0, 0]
    assert hosts._even_heads(3, [1, 4]) == [0, 3]
    with pytest.raises(hosts._Failed):
        hosts._even_heads(5, [1, 1, 3])


def test_balanced_hosts_heavy_documents_that_compete_for_cheap_fill(monkeypatch):
    """lognormal mix, layout 5, 8 ranks: documents of 4280 and 4212 tokens do 87% and 84% of a rank's
    work, and the short documents cannot fill both ranks around them. Runs cut off them, the ranks
    holding their documents' other rows receive 450 keys; hosted whole, with every other rank giving an
    even share of short heads to fill their ranks, no rank receives more than 160."""
    layout = DocLayout.from_lengths(workloads.layout("lognormal", 131072, 5))
    p = plan(layout, 8)
    s = p.stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1 and max(s.kv_recv) <= 160
    pieces = p.stream_pieces
    for d in torch.argsort(layout.lengths, descending=True)[:2].tolist():
        assert len(pieces.select(pieces.doc == d)) == 1  # whole
    assert sorted(s.kv_recv)[2] >= 100  # six ranks share the heads out
    monkeypatch.setattr(hosts, "HOST_SHARES", ())
    assert max(plan(layout, 8).stats().kv_recv) >= 400


def test_hosted_packings_only_where_heavy_documents_fit_a_rank():
    """No plans for a mask that looks ahead, for more than TRIM_RANKS ranks or TRIM_DOCS documents,
    where a document is longer than a rank's share, or where no document is heavy."""
    def plans(lengths, n, mask=Mask.causal()):
        lengths = torch.tensor(lengths)
        return hosts.hosted_packings(lengths, mask.row_work(0, lengths, lengths), n, mask, 1.01)

    many = workloads.layout("lognormal", 131072, 5)  # two documents of 85% of a rank's work over 8 ranks
    assert len(plans(many, 8)) == 1
    assert plans(many, 8, Mask.full()) == [] and plans(many, trims.TRIM_RANKS + 1) == []
    assert plans([*many, 20000], 8) == []  # (8 ranks of 18884 tokens)
    assert plans([5, 13, 40, 100] * 20, 4) == []  # none heavy
    assert plans([1] * trims.TRIM_DOCS + many, 8) == []


def _rows(pieces: Pieces) -> list[tuple[int, int, int]]:
    return sorted(zip(*(c.tolist() for c in (pieces.rank, pieces.start, pieces.end)), strict=True))


def test_packings_around_keep_the_placed_parts():
    """doccp.plan.trims.packings_around: around the nested parts of a document longer than a rank
    (doccp.plan.nested; zero-length and 1-token documents among the others, N 2-8), every plan tiles
    every document once and balances, and holds the parts exactly as placed (the packing cuts their
    document no further); a placement that leaves another document longer than a rank gets no plan."""
    nested = importlib.import_module("doccp.plan.nested")
    from doccp.plan.pieces import even_sizes
    rng, mask, planned = random.Random(0), Mask.causal(), 0
    for _ in range(40):
        n = rng.randint(2, 8)
        lengths = [rng.choice([0, 1, 2, 3, 5, 8, 13, 21, 34, 55]) for _ in range(rng.randint(4 * n, 12 * n))]
        big = rng.randint(sum(lengths) // (n - 1) + 2, 3 * sum(lengths) // (n - 1) + 2) if n > 2 else sum(lengths) + 9
        d = rng.randrange(len(lengths) + 1)
        lengths.insert(d, big)
        layout = DocLayout.from_lengths(lengths)
        work = mask.row_work(0, layout.lengths, layout.lengths)
        assert big > layout.num_tokens // n  # longer than a rank: the packing alone does not take it
        assert trims.trimmed_packings(layout.lengths, work, n, mask, 1.01) == []
        fill = float(work.sum() - work[d]) / max(layout.num_tokens - big, 1)
        cap = 1.005 * float(work.sum()) / n
        for parts in nested.nested_parts(d, big, even_sizes(layout.num_tokens, n), cap, [fill, 0.3 * fill], mask):
            if parts is None:
                continue
            (plans,) = trims.packings_around(layout.lengths, work, n, mask, 1.01, [parts])
            for p in plans:
                _assert_tiles_and_balances(p, layout, n, mask)
                mine = p.select(p.doc == d)
                assert _rows(mine) == _rows(parts)
                planned += 1
    assert planned >= 20
    # Two documents longer than a rank, the parts of one placed: no plan for that placement.
    lengths = torch.tensor([40, 3, 5, 0, 1, 40, 8, 2, 1])
    work = mask.row_work(0, lengths, lengths)
    parts = Pieces.of([0, 0, 1], 0, [0, 30, 12], [12, 40, 30])
    assert list(trims.packings_around(lengths, work, 3, mask, 1.01, [parts])) == [[]]
    assert list(trims.packings_around(lengths, work, 3, Mask.full(), 1.01, [parts])) == []  # looks ahead


def test_balanced_packs_around_nested_big_documents(monkeypatch):
    """lognormal mix, layout 5, 16 ranks: documents of 4280, 4212 and 3281 tokens each do more than a
    rank's work among many short ones. Nested on ranks of their own with the short documents packed
    whole around them, no rank receives more than 2400 keys; the sequence's plans receive 4217."""
    layout = DocLayout.from_lengths(workloads.layout("lognormal", 131072, 5))
    s = plan(layout, 16).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1 and max(s.kv_recv) <= 2400
    monkeypatch.setattr(balanced, "_packed_around_nested", lambda *args: [])
    assert max(plan(layout, 16).stats().kv_recv) >= 4000


def test_packing_pins_at_most_pack_docs(monkeypatch):
    """The packing's greedy is a Python step per document: it pins the PACK_DOCS heaviest at most,
    and the lighter ones join the reserve (the plan stays exact and balanced)."""
    monkeypatch.setattr(balanced, "PACK_DOCS", 5)
    layout = DocLayout.from_lengths(list(range(1, 41)))
    doc_work = Mask.causal().pairs(0, layout.lengths, 0, layout.lengths)
    whole = torch.ones(layout.num_docs, dtype=torch.bool)
    pinned = balanced._packings(layout.lengths, doc_work, 2, whole, (0.1,))[0.1]
    assert pinned[35:].ge(0).sum() == 5 and not bool(pinned[:35].ge(0).any())  # the 5 heaviest
    s = plan(layout, 2).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 3, 9, 13, 30, 48, 88, 200]), min_size=1, max_size=12), st.integers(2, 8))
@example([9, 2, 2, 1], 4)
@example([0, 13, 2], 2)
@example([1, 1, 1, 30], 3)
@example([2, 2, 1, 48], 4)
def test_balanced_balances_wherever_head_tail_does(lengths, n):
    """Tiny layouts can defeat the search's cuts (4 documents of 9, 2, 2 and 1 tokens over 4 ranks:
    its best plan did 1.15x the mean work); head_tail balances every document on its own under a
    causal mask, and balanced falls back to it rather than return an unbalanced plan."""
    layout = DocLayout.from_lengths(lengths)
    if plan(layout, n, Mask.causal(), "head_tail").stats().imbalance <= 1.01:
        s = plan(layout, n).stats()
        assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1


def test_balanced_falls_back_to_head_tail_only_where_nothing_else_balances():
    layout = DocLayout.from_lengths([9, 2, 2, 1])
    ours, theirs = plan(layout, 4), plan(layout, 4, Mask.causal(), "head_tail")
    assert ours.pieces(0) == theirs.pieces(0) and ours.stats().imbalance <= 1.01
    readme = plan(DocLayout.from_lengths([300, 40, 1000, 7, 700]), 4)  # balanced by the search itself
    assert readme.pieces(0) != plan(readme.layout, 4, Mask.causal(), "head_tail").pieces(0)


@pytest.mark.parametrize(("lengths", "n", "mask", "before"), [
    ([119, 23, 126, 304, 108, 5, 2, 12, 18, 321, 55, 78, 104, 13, 94, 88, 7, 73], 23, Mask.full(), 1.711),
    ([0, 39, 2], 16, Mask.causal(), 1.594),
    ([1, 0, 49, 1, 31, 3, 3, 0, 17, 1], 32, Mask.causal(), 1.643),
    ([3, 18, 1, 22, 3, 3, 3, 3, 3, 0], 16, Mask.full(), 1.279)])
def test_balanced_keeps_the_plan_nearest_balance_where_none_balances(lengths, n, mask, before):
    """Where no candidate (head_tail's included) reaches the tolerance, the least KV used to win
    among them, at any spread; now the spread counts first, in steps of the tolerance, so the plan
    is within one step of head_tail's (``before``: the spread the least-KV rule returned)."""
    layout = DocLayout.from_lengths(lengths)
    ours, theirs = plan(layout, n, mask).stats(), plan(layout, n, mask, "head_tail").stats()
    assert theirs.imbalance > 1.01  # nothing balances here
    assert ours.imbalance < balanced.TOLERANCE * theirs.imbalance < before
    assert max(ours.tokens) - min(ours.tokens) <= 1 and sum(ours.tokens) == sum(lengths)


def test_unbalanced_plans_compare_by_spread_in_steps_of_the_tolerance():
    step = balanced._unbalanced
    assert step(1.0) == step(1.01) == 0 and step(1.0101) == step(1.0200) == 1 and step(1.0202) == 2
    assert step(1.71) == 53
    near, cheap = (1, 740, 3, 1.0137), (53, 558, 3, 1.71)  # the 23-rank layout's two candidates
    assert balanced._better(near, cheap) and not balanced._better(cheap, near)
    assert balanced._better((1, 700, 3, 1.019), near)  # within one step: the least KV
    assert balanced._better((0, 10**6, 9, 1.01), near)  # balanced beats any unbalanced plan


def test_packings_never_lose_a_plan_the_search_finds(monkeypatch, unpolished):
    """The packings compete with the search's best at its end, never end it early: with them the
    plan scores at least as well as the search's alone (on a long-mix layout where a packing that
    cut no short document once stopped the search before a pinning pass found 20% less KV, and on
    small batches of every mix). The two-rank candidate is off: it runs only while the best plan
    receives more than TWO_RANKS_KV of an all-gather, which a packing may already beat by itself;
    and so is the polish (``unpolished``), which starts from whichever plan the search ends with."""
    monkeypatch.setattr(balanced, "TWO_RANKS_KV", float("inf"))
    cases = [(workloads.layout("long", 131072, 11), 3)]
    cases += [(workloads.layout(mix, 8192, i), n) for mix in workloads.MIXES for i in range(2) for n in (2, 3, 5, 8)]
    packed = [plan(DocLayout.from_lengths(lengths), n).stream_pieces for lengths, n in cases]
    monkeypatch.setattr(balanced, "PACK_RANKS", 0)
    for (lengths, n), with_packings in zip(cases, packed, strict=True):
        layout = DocLayout.from_lengths(lengths)
        alone = plan(layout, n).stream_pieces
        whole = _whole(layout, n, Mask.causal())
        ours, theirs = (balanced._score(p, layout, n, Mask.causal(), whole)[0] for p in (with_packings, alone))
        assert ours == theirs or balanced._better(ours, theirs), (lengths, n, ours, theirs)


@pytest.mark.parametrize(("mix", "n", "index", "before"), [
    ("pretrain", 2, 9, 0.116), ("lognormal", 2, 3, 0.019), ("sft", 2, 4, 0.021), ("sft", 4, 0, 0.020)])
def test_balanced_packs_documents_whole_where_few_ranks_share_many(monkeypatch, unpolished, mix, n, index, before):
    """With few ranks, whole documents packed onto the ranks balance them, and the sequence shares
    out only a reserve of short ones: the KV falls to a fraction of a percent of an all-gather
    (``before``: the sequence plans alone, checked with the packings off)."""
    layout = DocLayout.from_lengths(workloads.layout(mix, 131072, index))
    s = plan(layout, n).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.005
    monkeypatch.setattr(balanced, "PACK_RANKS", 0)
    monkeypatch.setattr(balanced, "TWO_RANKS_KV", float("inf"))  # (over 2 ranks it finds such plans too)
    monkeypatch.setattr(trims, "TRIM_RANKS", 0)  # (and so does the trimmed packing)
    assert plan(layout, n).stats().max_kv_fraction == pytest.approx(before, abs=0.001)


def test_balanced_holds_head_and_tail_of_a_dominant_document():
    """One document of ~57% of the tokens over 2 ranks (the Pareto mix's worst case): its tail
    alone on a rank would need a prefix of ~0.7 L; head and tail on one rank need only the
    middle, and the other rank only the head."""
    layout = DocLayout.from_lengths([7000] + [40] * 130)
    p = plan(layout, 2)
    s = p.stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert max(s.kv_recv) <= 0.5 * 7000, s.kv_recv
    holders = [sorted((a, b) for d, a, b in p.pieces(r) if d == 0) for r in range(2)]
    assert sorted(len(h) for h in holders) == [1, 2], holders  # head + tail on one rank, the middle on the other


def test_nested_parts_per_density_ranks_match_a_call_each():
    """nested_parts with a row of rank tokens per fill density (padded with ranks of no tokens) sizes
    each density's parts exactly as a call of its own on those ranks (balanced sizes a document for
    every density at once, each on the ranks its previous document left)."""
    from doccp.plan.nested import nested_parts
    rng, mask, found = random.Random(3), Mask.causal(), 0
    for _ in range(40):
        n, length = rng.randint(2, 10), rng.randint(1, 3000)
        tokens = torch.tensor([rng.randint(length // n + 1, length + 1) for _ in range(n)])
        cap = rng.uniform(1.0, 1.6) * float(mask.row_work(0, length, length)) / min(n, 3)
        fills = [rng.uniform(0.0, 100.0) for _ in range(3)]
        starts = [rng.randrange(n) for _ in fills]
        rows = torch.stack([torch.cat([tokens[s:], tokens.new_zeros(s)]) for s in starts])
        for fill, start, parts in zip(fills, starts, nested_parts(7, length, rows, cap, fills, mask), strict=True):
            (alone,) = nested_parts(7, length, tokens[start:], cap, [fill], mask)
            assert (parts is None) == (alone is None)
            if parts is not None:
                assert _rows(parts) == _rows(alone) and set(parts.doc.tolist()) == {7}
                found += 1
    assert found >= 30


def test_balanced_tries_the_head_shares_that_even_out_the_receivers(monkeypatch):
    """Lognormal mix, N = 8: a document of 3.2 ranks' work goes to a group of ranks, head and tail on
    one of them. Its head share decides which receiver is worst: the head-and-tail rank receives the
    middle, the last middle rank the prefix before its part. With the shares 0.25 and 0.4 alone the
    worst received 0.0777 of an all-gather; share 0.2 evens them out: 0.0757. (With the best plan
    alone polished, as then: polishing the next leaders too finds 0.0746 without share 0.2; the plans
    packed around the document's nested parts, 0.0713.)"""
    from doccp.app import workloads
    layout = DocLayout.from_lengths(workloads.layout("lognormal", 131072, 2))
    s = plan(layout, 8).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.0720, s.kv_recv
    monkeypatch.setattr(balanced, "POLISHED", 1)
    assert plan(layout, 8).stats().max_kv_fraction <= 0.0760
    monkeypatch.setattr(balanced, "_packed_around_nested", lambda *args: [])  # (which finds 0.0713 here)
    monkeypatch.setattr(balanced, "BISECT_HEAD_BACK", ((0.0, False), (0.25, False), (0.4, True)))
    assert plan(layout, 8).stats().max_kv_fraction == pytest.approx(0.0777, abs=0.0002)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 5000), st.lists(st.integers(1, 4000), min_size=2, max_size=8), st.floats(1.0, 1.5),
       st.floats(0.0, 200.0))
@example(16, [1, 1, 1, 2, 2, 3, 6, 4], 1.5, 7.0)  # rank 7 holds none of it: 4 tokens of fill are over the cap
def test_nested_parts_keep_every_bound_they_promise(length, rank_tokens, cap_share, fill):
    """The nested parts tile the document, each rank's enclose the next ones', and every rank holds
    at most its tokens and, filled up at the fill density, at most the cap of work (the ranks
    inside the innermost one too)."""
    from doccp.plan.nested import nested_parts
    mask, tokens = Mask.causal(), torch.tensor(rank_tokens)
    cap = cap_share * float(mask.row_work(0, length, length)) / len(rank_tokens)
    parts = nested_parts(7, length, tokens, cap, [fill], mask)[0]
    if parts is None:
        return
    assert bool((parts.doc == 7).all()) and bool((parts.end > parts.start).all())
    order = torch.argsort(parts.start)
    assert int(parts.start[order[0]]) == 0 and int(parts.end[order[-1]]) == length
    assert bool((parts.start[order[1:]] == parts.end[order[:-1]]).all())  # they tile [0, length)
    held = torch.zeros(len(rank_tokens), dtype=torch.int64).index_add_(0, parts.rank, parts.length)
    work = torch.zeros(len(rank_tokens), dtype=torch.float64).index_add_(
        0, parts.rank, mask.row_work(parts.start, parts.end, length).double())
    assert bool((held <= tokens).all())
    assert bool((work + fill * (tokens - held).double() <= cap * (1 + 1e-12)).all())
    # nested: the parts of ranks r, r + 1, ... are one run of the document for every r (rank r's
    # head below the later ranks' run, its tail above it)
    for r in parts.rank.unique().tolist():
        inner = parts.select(parts.rank >= r)
        order = torch.argsort(inner.start)
        assert bool((inner.start[order[1:]] == inner.end[order[:-1]]).all()), (r, parts)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 3000), st.integers(0, 600), st.integers(2, 8), st.floats(1.0, 1.4))
@example(71580, 59492, 0, 4, 1.01)  # long #2 over 4 ranks: the second document's head donated to rank 1
def test_opposed_parts_keep_every_bound_they_promise(first, second, rest, n, cap_share):
    """Two documents nested from opposite ends: the parts tile both; every rank but the shared one
    holds exactly its tokens of them, the shared one leaves exactly the other documents' tokens,
    and every rank's work is within the cap (the shared one's with the other documents'); one is
    nested from rank 0, the other from rank N - 1 but for a head on a rank of the first; the
    layouts are distinct and come least KV first."""
    from doccp.plan.nested import opposed_parts
    from doccp.plan.pieces import even_sizes
    mask, tokens = Mask.causal(), even_sizes(first + second + rest, n)
    work_of = [float(mask.row_work(0, x, x)) for x in (first, second, rest)]
    cap = cap_share * sum(work_of) / n
    layouts = opposed_parts((7, 9), (first, second), tokens, cap, work_of[2], mask)
    kvs = []
    for parts in layouts:
        assert bool((parts.end > parts.start).all())
        for doc, length in ((7, first), (9, second)):
            p = parts.select(parts.doc == doc)
            order = torch.argsort(p.start)
            assert int(p.start[order[0]]) == 0 and int(p.end[order[-1]]) == length
            assert bool((p.start[order[1:]] == p.end[order[:-1]]).all())  # each document tiled
        held = torch.zeros(n, dtype=torch.int64).index_add_(0, parts.rank, parts.length)
        short = torch.nonzero(held != tokens).flatten()
        assert short.numel() <= 1 and int((tokens - held).sum()) == rest and bool((held <= tokens).all())
        work = torch.zeros(n, dtype=torch.float64).index_add_(
            0, parts.rank, mask.row_work(parts.start, parts.end, torch.where(parts.doc == 7, first, second)).double())
        work[short] += work_of[2]
        assert bool((work <= cap * (1 + 1e-12)).all())
        on_zero = parts.select(parts.rank == 0)  # nested from rank 0: its tail is there (a donated head starts at 0)
        tail = (on_zero.start > 0) & (on_zero.end == torch.where(on_zero.doc == 7, first, second))
        from_zero = int(on_zero.doc[tail])
        a, b = parts.select(parts.doc == from_zero), parts.select(parts.doc != from_zero)
        shared = int(a.rank.max())
        donated = b.select((b.start == 0) & (b.rank < shared))  # the second's head on a rank of the first
        b = b.select(~((b.start == 0) & (b.rank < shared)))
        assert len(donated) <= 1 and (len(b) == 0 or int(b.rank.min()) == shared)
        for doc_parts, outward in ((a, 1), (b, -1)):  # nested: from rank 0, from rank N - 1
            for r in doc_parts.rank.unique().tolist():
                run = doc_parts.select(doc_parts.rank * outward >= r * outward)
                order = torch.argsort(run.start)
                assert bool((run.start[order[1:]] == run.end[order[:-1]]).all()), (r, parts)
        top = torch.zeros(n * 2, dtype=torch.int64).scatter_reduce_(
            0, parts.rank * 2 + (parts.doc == 9).long(), parts.end, "amax").view(n, 2)
        kvs.append(int((top.sum(1) - held).max()))
    assert kvs == sorted(kvs) and len({torch.cat([p.rank, p.doc, p.start]).numpy().tobytes() for p in layouts}) == len(
        layouts)
    if (first, second, rest, n) == (71580, 59492, 0, 4):
        assert kvs[0] <= 47000  # (the planner before them: 61392; the lower bound 38812)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5000), st.lists(st.integers(1, 4000), min_size=2, max_size=8), st.floats(1.0, 1.5),
       st.lists(st.floats(0.0, 200.0), min_size=2, max_size=4))
def test_nested_parts_of_several_fills_are_each_alone(length, rank_tokens, cap_share, fills):
    """Several fill densities are searched in one vectorised pass: each one's parts are the parts
    it gets alone (no bound's pass depends on another's)."""
    from doccp.plan.nested import nested_parts
    mask, tokens = Mask.causal(), torch.tensor(rank_tokens)
    cap = cap_share * float(mask.row_work(0, length, length)) / len(rank_tokens)
    for fill, together in zip(fills, nested_parts(7, length, tokens, cap, fills, mask), strict=True):
        alone = nested_parts(7, length, tokens, cap, [fill], mask)[0]
        assert (together is None) == (alone is None)
        if alone is not None:
            assert all(torch.equal(getattr(together, c), getattr(alone, c)) for c in ("rank", "doc", "start", "end"))


def test_nested_parts_of_a_dominant_document():
    """Pareto mix, N = 4: a document of 57% of the tokens and 99% of the work. Each rank takes a
    head and a tail of what the ranks outside it left, sized so that every rank receives about the
    same: no rank receives more than 49% of an all-gather (balanced's best plan otherwise: 52%)."""
    from doccp.plan.nested import nested_parts
    layout = DocLayout.from_lengths(workloads.layout("pareto", 131072, 0))
    mask, n = Mask.causal(), 4
    lengths, work = layout.lengths, mask.row_work(0, layout.lengths, layout.lengths).double()
    doc = int(torch.argmax(lengths))
    fill = float(work.sum() - work[doc]) / (layout.num_tokens - int(lengths[doc]))
    parts = nested_parts(doc, int(lengths[doc]), torch.full((n,), 32768), 1.005 * float(work.sum()) / n, [fill],
                         mask)[0]
    assert sorted(torch.bincount(parts.rank).tolist()) == [1, 2, 2, 2]  # three heads and tails, one middle
    held = torch.zeros(n, dtype=torch.int64).index_add_(0, parts.rank, parts.length)
    top = torch.zeros_like(held).scatter_reduce(0, parts.rank, parts.end, "amax")
    assert int((top - held).max()) <= 0.49 * (layout.num_tokens - layout.num_tokens // n)


def test_balanced_pins_the_nested_parts_of_a_dominant_document(monkeypatch, unpolished):
    """The same layout planned: the nested parts pinned, the other documents packed around them (the
    same plan whether its configurations are solved in one pass or one at a time)."""
    layout = DocLayout.from_lengths(workloads.layout("pareto", 131072, 0))
    s = plan(layout, 4).stats()
    whole, work = _whole(layout, 4, Mask.causal()), Mask.causal().row_work(0, layout.lengths, layout.lengths)
    doc = int(torch.argmax(layout.lengths))
    together, alone = (balanced._nested_plan(layout, 4, Mask.causal(), whole, work, [doc], at_once=at_once)
                       for at_once in (True, False))
    assert together[1] == alone[1] and torch.equal(together[0].start, alone[0].start)
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.49, s.kv_recv
    monkeypatch.setattr(balanced, "_nested_plan", lambda *args, **kwargs: None)
    monkeypatch.setattr(balanced, "_packed_around_nested", lambda *args: [])  # (its parts too: 0.4855)
    assert plan(layout, 4).stats().max_kv_fraction == pytest.approx(0.5223, abs=0.0005)


def test_nested_plan_is_skipped_only_where_it_cannot_win(monkeypatch):
    """The nested candidate stops after its parts where their own KV (each holder's keys of the
    document it lacks) already loses to the best plan: only where the full candidate would lose
    (checked for the parts of each fill density on its own)."""
    mask, skipped, solved = Mask.causal(), 0, 0
    for mix, i, n, fill in itertools.product(("pareto", "pretrain", "lognormal"), range(4), (2, 3, 4),
                                             balanced.NESTED_FILLS):
        monkeypatch.setattr(balanced, "NESTED_FILLS", (fill,))
        layout = DocLayout.from_lengths(workloads.layout(mix, 8192, i))
        whole, work = _whole(layout, n, mask), mask.row_work(0, layout.lengths, layout.lengths)
        big = torch.nonzero(~whole & (layout.lengths > 0)).flatten()
        if not 0 < big.numel() <= balanced.NESTED_DOCS:
            continue
        big = big[torch.argsort(work[big], descending=True, stable=True)].tolist()
        with monkeypatch.context() as m:
            m.setattr(balanced, "_nested_plan", lambda *args, **kwargs: None)
            p = plan(layout, n, mask).stream_pieces
        best = balanced._score(p, layout, n, mask, whole)[0]
        full = balanced._nested_plan(layout, n, mask, whole, work, big)
        if balanced._nested_plan(layout, n, mask, whole, work, big, best=best) is None:
            skipped += 1
            assert full is None or not balanced._better(full[1], best), (mix, i, n, fill)
        else:
            solved += 1
    assert skipped and solved  # both ways taken


def test_costlier_candidates_run_above_a_twentieth_of_an_all_gather_over_few_ranks(monkeypatch):
    """Pareto #2 over 6 ranks (131k tokens; documents of 10942 and 9377 tokens too big to stay whole):
    the search's plan receives 0.075 of an all-gather, where the costlier candidates stop above 0.08
    (KV_BIG, KV_BIG_TOKENS: beyond PACK_RANKS ranks); over few ranks they run above 0.05
    (KV_BIG_FEW), and the nested parts give 0.050, still balanced (the lower bound: 0.043; the
    contiguous split, unbalanced: 0.054)."""
    layout = DocLayout.from_lengths(workloads.layouts("pareto", 131072, 8)[2])
    s = plan(layout, 6).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.051, s.max_kv_fraction
    monkeypatch.setattr(balanced, "KV_BIG_FEW", balanced.KV_BIG)
    monkeypatch.setattr(balanced, "KV_BIG_FEW_TOKENS", balanced.KV_BIG_TOKENS)
    monkeypatch.setattr(balanced, "_packed_around_nested", lambda *args: [])  # (ungated: it finds 0.0499)
    assert plan(layout, 6).stats().max_kv_fraction == pytest.approx(0.0749, abs=0.0005)


@pytest.mark.parametrize("lengths, n", [([3579, 2975], 8), ([137, 40, 6747, 117, 6066], 16)])
def test_balanced_gives_each_big_document_its_own_ranks(lengths, n):
    """Two documents of about half the tokens each: one sequence over all ranks put one's tail and
    the other's head on the same ranks (a rank received most of both prefixes: 0.69-0.70 of an
    all-gather); the bisection splits the ranks into groups sized for each document and comes
    within 0.05 of the unbalanced contiguous split (whose worst rank holds one document's end)."""
    layout = DocLayout.from_lengths(lengths)
    s = plan(layout, n).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= plan(layout, n, strategy="contiguous").stats().max_kv_fraction + 0.05
    assert s.max_kv_fraction <= 0.6


def test_balanced_fills_a_big_document_with_a_window():
    """Pretrain mix, N = 4: the biggest document (0.88 of a rank's work) and the lightest documents
    miss 4% of the work; front + back filled in with the last 314 tokens of the next big document
    (0.78), and that rank received 0.117 of an all-gather. A window of mid-density documents in
    place of the back run keeps both whole: within 0.05 of the (unbalanced) contiguous split."""
    from doccp.app import workloads
    layout = DocLayout.from_lengths(workloads.layout("pretrain", 131072, 3))
    s = plan(layout, 4).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= plan(layout, 4, strategy="contiguous").stats().max_kv_fraction + 0.05, s.kv_recv


@pytest.mark.parametrize("pieces", [
    ([0, 1], [0, 1], [0, 0], [4, 3]),  # token 4 of document 0 held by nobody
    ([0, 1, 1], [0, 0, 1], [0, 4, 0], [5, 5, 3]),  # token 4 of document 0 held twice
    ([0, 1], [0, 1], [0, 1], [6, 3]),  # a piece past its document's end (the totals still add up)
    ([0, 1, 1], [0, 1, 1], [0, -1, 2], [4, 2, 3]),  # a piece reaching back into the previous document
], ids=["gap", "overlap", "past-end", "before-start"])
@pytest.mark.parametrize("batch", [1, 2, None])
def test_plan_refuses_pieces_that_do_not_tile_the_stream(monkeypatch, pieces, batch):
    """The partition guard of :func:`plan` (stream offsets shared with the schedules) turns a
    strategy bug into an error instead of a plan that drops or doubles tokens, however small the
    spans it checks at a time."""
    if batch:
        monkeypatch.setattr(importlib.import_module("doccp.ranges"), "BATCH", batch)
    monkeypatch.setitem(STRATEGIES, "head_tail", lambda layout, n, mask: Pieces.of(*pieces))
    with pytest.raises(RuntimeError, match="did not partition the stream"):
        plan(DocLayout.from_lengths([5, 3]), 2, Mask.causal(), "head_tail")


@SETTINGS
@given(st.integers(3, 16).flatmap(lambda n: st.tuples(layouts(n), st.just(n), masks)))
def test_bisection_plan_partitions_the_stream(case):
    """The recursive bisection planner on any layout (zero-length and 1-token documents, T < N,
    one document), every variant (head shares, windows, late heads) solved in one pass: each
    plan's pieces tile the stream, tokens per rank within one."""
    from doccp.plan import _partitions
    lengths, n, mask = case
    layout = DocLayout.from_lengths(lengths)
    if layout.num_tokens == 0:
        return
    for pieces in balanced._bisection_plans(layout, n, mask, _whole(layout, n, mask), BISECTIONS):
        p = Plan(layout, n, mask, "balanced", pieces.stream_normalized())
        assert _partitions(p)
        assert max(p.local_sizes) - min(p.local_sizes) <= 1
        assert owners(p).ge(0).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12).flatmap(lambda n: st.tuples(layouts(n), st.just(n), masks)))
# A window ending at its group's end: the snap's nearby boundaries came from the next group's chunks.
@example(([4, 4, 4, 5, 6, 10, 10, 10, 10, 10, 13, 20, 18, 21, 21, 22, 25, 25, 30], 6, Mask.sliding_window(2, 0)))
def test_bisection_variants_solved_together_are_each_alone(case):
    """The variants share one pass of vectorised calls as rank groups of their own; no group may
    sway another (a bisection row that stops early, a tie-break scaled by another plan's groups,
    the penalty of a cut that could be avoided, a cut at a group's end snapped onto the next
    group's boundaries), so each plan is the one it gets alone."""
    lengths, n, mask = case
    layout = DocLayout.from_lengths(lengths)
    if layout.num_tokens == 0:
        return
    whole = _whole(layout, n, mask)
    together = balanced._bisection_plans(layout, n, mask, whole, BISECTIONS)
    for variant, pieces in zip(BISECTIONS, together, strict=True):
        alone = balanced._bisection_plans(layout, n, mask, whole, [variant])[0]
        assert all(torch.equal(getattr(pieces.stream_normalized(), f), getattr(alone.stream_normalized(), f))
                   for f in ("rank", "doc", "start", "end")), variant


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 9).flatmap(lambda n: st.tuples(layouts(n), st.just(n), masks)), st.randoms(use_true_random=False))
def test_sequence_plans_solved_together_are_each_alone(case, rng):
    """The search solves sequence plans ahead, several (chunking, pinned documents) in one pass as
    groups of their own; each plan must be the one it gets alone, and a configuration whose pins
    overfill a rank gives None without swaying the others."""
    lengths, n, mask = case
    layout = DocLayout.from_lengths(lengths)
    if layout.num_tokens == 0:
        return
    whole, doc_work = _whole(layout, n, mask), mask.pairs(0, layout.lengths, 0, layout.lengths)
    chunkings = [balanced.Chunking(c) for c in balanced.CHUNKS_PER_RANK] + [balanced.Chunking(0, 0.2)]
    configs = []
    for chunking in chunkings:
        pinned = torch.full_like(layout.lengths, -1)
        for d in range(layout.num_docs):
            if rng.random() < 0.3:
                pinned[d] = rng.randrange(n)
        configs.append((chunking, pinned))
    together = balanced._sequence_plans(layout, n, mask, configs, whole, doc_work)
    for config, pieces in zip(configs, together, strict=True):
        alone = balanced._sequence_plans(layout, n, mask, [config], whole, doc_work)[0]
        assert (pieces is None) == (alone is None)
        if pieces is not None:
            assert all(torch.equal(getattr(pieces, f), getattr(alone, f)) for f in ("rank", "doc", "start", "end"))


def test_grouped_sequence_charges_each_plan_its_own_penalty():
    """A cut that could be avoided costs more than any KV of *its* plan: one plan's tokens, which
    differ between the configurations of one pass (pinned documents leave the sequence)."""
    layout = DocLayout.from_lengths([30, 30, 30])
    mask, n = Mask.causal(), 2
    whole = _whole(layout, n, mask)
    assert bool(whole.all())
    pinned_out = torch.tensor([0, 30, 30])  # the first document pinned: 30 tokens leave that sequence
    seq = balanced.Sequence.of_layouts([(balanced.Chunking(0), layout.lengths), (balanced.Chunking(0), pinned_out)],
                                       layout.lengths, mask, 45, whole)
    base = seq.group_bounds(None)[0]
    cost = seq.cut_cost(base + 1)  # one token into each group's first (densest, whole-able) chunk
    kv = seq.start[seq.locate(base + 1)[0]] + seq.lengths[seq.locate(base + 1)[0]] - 1
    assert cost.tolist() == (kv.double() + torch.tensor([90.0, 60.0])).tolist()


def test_solving_ahead_never_changes_the_plan(monkeypatch):
    """Small layouts solve the probes and the pinning passes ahead, in one pass per round, and the
    search replays them; the plans must be the ones the search finds solving one at a time (the
    README example, where the search runs long to keep its short documents whole, and small
    batches of every mix)."""
    from doccp.app import workloads
    cases = [([300, 40, 1000, 7, 700], 4)] + [(workloads.layout(mix, 8192, i), n) for mix in workloads.MIXES
                                               for i in range(2) for n in (2, 3, 5)]
    widths = []
    solve = balanced._sequence_plans
    monkeypatch.setattr(balanced, "_sequence_plans", lambda *a: widths.append(len(a[3])) or solve(*a))
    ahead = [plan(DocLayout.from_lengths(lengths), n, Mask.causal(), "balanced") for lengths, n in cases]
    assert max(widths) > 4  # the lockstep passes ran
    monkeypatch.setattr(balanced, "LOCKSTEP_CHUNKS", 0)
    widths.clear()
    for (lengths, n), p in zip(cases, ahead, strict=True):
        alone = plan(DocLayout.from_lengths(lengths), n, Mask.causal(), "balanced")
        assert all(torch.equal(getattr(p.stream_pieces, f), getattr(alone.stream_pieces, f))
                   for f in ("rank", "doc", "start", "end")), (lengths, n)
    assert max(widths) == 1


def _random_sequence(seed: int) -> tuple[DocLayout, balanced.Sequence]:
    """A causal sequence of 30 random documents (up to 300 tokens) for 4 ranks; torch seeded too."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layout = DocLayout.from_lengths([rng.randrange(0, 300) for _ in range(30)])
    mask, n = Mask.causal(), 4
    return layout, balanced.Sequence.of_layout(layout.lengths, mask, -(-layout.num_tokens // n),
                                               _whole(layout, n, mask), balanced.Chunking(4))


def test_sequence_solve_rows_are_independent():
    """Each row's root is its own bisection's: the same whether solved alone or beside rows that take
    more steps, and never outside its bracket."""
    layout, seq = _random_sequence(0)
    rows = 300
    k = torch.randint(1, layout.num_tokens, (rows,))
    lo = (torch.rand(rows) * k).long()
    hi = lo + (torch.rand(rows) ** 4 * (k - lo)).long()  # brackets of very different widths
    goal = seq.held(k // 2, k) * (0.5 + torch.rand(rows, dtype=torch.float64))
    together = seq.solve(k, goal, lo, hi)
    alone = torch.cat([seq.solve(k[i:i + 1], goal[i:i + 1], lo[i:i + 1], hi[i:i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)
    assert bool(((together >= lo) & (together <= hi)).all())


@pytest.mark.parametrize("levels", [1, 2, 4])
def test_sequence_solve_is_the_plain_bisection(monkeypatch, levels):
    """Several bisection steps per evaluation (a tree of midpoints, then the path the values
    choose) find each row's root of the plain one-step bisection, written out here row by row:
    solved brackets (lo == hi) stay put, falling rows (rising False) take the lower half above the
    goal, and the root is the closer of the last two candidates."""
    monkeypatch.setattr(balanced, "SOLVE_LEVELS", levels)
    layout, seq = _random_sequence(1)
    rows = 60
    k = torch.randint(1, layout.num_tokens, (rows,))
    lo = (torch.rand(rows) * k).long()
    hi = torch.where(torch.arange(rows) % 5 == 0, lo, lo + (torch.rand(rows) * (k - lo)).long())
    goal = seq.held(k // 2, k) * (0.5 + torch.rand(rows, dtype=torch.float64))
    rising = torch.rand(rows) < 0.7
    got = seq.solve(k, goal, lo, hi, rising=rising)

    def held(x: int, i: int) -> float:
        return float(seq.held(torch.tensor([x]), k[i:i + 1])[0])

    for i in range(rows):
        a, b = int(lo[i]), int(hi[i])
        while a < b:
            mid = (a + b) // 2
            a, b = (mid + 1, b) if (held(mid, i) < float(goal[i])) == bool(rising[i]) else (a, mid)
        prev = max(a - 1, int(lo[i]))
        want = prev if abs(held(prev, i) - float(goal[i])) < abs(held(a, i) - float(goal[i])) else a
        assert int(got[i]) == want, (i, int(lo[i]), int(hi[i]))

def _scale_sequence(tokens: int, n: int, chunking: balanced.Chunking):
    """The lognormal layout of ``tokens`` over ``n`` ranks as the planner's sequence: its roots for
    every rank, and what :func:`balanced._monotone` needs (one plan)."""
    from doccp.plan.pieces import even_sizes
    layout = DocLayout.from_lengths(workloads.layout("lognormal", tokens, 0))
    mask = Mask.causal()
    seq = balanced.Sequence.of_layout(layout.lengths, mask, -(-layout.num_tokens // n), _whole(layout, n, mask),
                                      chunking)
    mean = float(mask.row_work(0, layout.lengths, layout.lengths).sum()) / n
    k = torch.cumsum(even_sizes(layout.num_tokens, n), 0)[:-1]
    goal = torch.arange(1, n, dtype=torch.float64) * mean
    return seq, k, goal, mean, seq.solve(k, goal, torch.zeros_like(k), k.clone())


@pytest.mark.parametrize("tokens, n, chunking", [(1 << 20, 256, balanced.Chunking(0)),
                                                 (1 << 21, 512, balanced.Chunking(0)),
                                                 (1 << 21, 512, balanced.Chunking(4))])
def test_monotone_cuts_keep_every_rank_balanced(tokens, n, chunking):
    """Where a big document's cheap head is lighter than what follows it in the sequence, the work
    ranks 0..r hold rises and falls with the front cut, and a rank's root may lie behind the previous
    rank's cut (or too far ahead of it). Every cut of these layouts hits its goal; made monotone, they
    still do: offenders are solved again one run at a time (not beside the next rank, whose window
    the offender's new cut moves), on a grid first, or the previous rank moves to another of its
    roots (2M tokens over 512 ranks: rank 489's roots all lie behind rank 488's). The old repair left
    ranks at 1.03-1.04 of the mean work here, and the planner fell back to its bisection (5x slower)."""
    seq, k, goal, mean, x = _scale_sequence(tokens, n, chunking)
    assert float(((seq.held(x, k) - goal) / mean).abs().max()) < 0.003  # the roots hit their goals
    tokens_of = torch.diff(k, prepend=k.new_zeros(1))
    assert bool(((x[1:] < x[:-1]) | (x[1:] > x[:-1] + tokens_of[1:])).any())  # but not monotone
    fixed = balanced._monotone(seq, x, k, goal, None)
    runs = torch.diff(fixed, prepend=fixed.new_zeros(1))
    assert bool(((runs >= 0) & (runs <= tokens_of)).all())
    held = torch.diff(torch.cat([seq.held(fixed, k), torch.tensor([seq.total_work])]), prepend=torch.zeros(1))
    assert float(held.max()) / mean <= 1.004


def test_solve_within_finds_a_crossing_inside_its_window():
    """A repair's cut lies in its window, and where the window's grid crosses the goal it is that
    crossing's root (within one row's work of the goal), else the grid's closest cut."""
    layout, seq = _random_sequence(2)
    rows = 200
    k = torch.randint(1, layout.num_tokens, (rows,))
    lo = (torch.rand(rows) * k).long()
    hi = lo + (torch.rand(rows) * (k - lo)).long()
    goal = seq.held(k // 2, k) * (0.5 + torch.rand(rows, dtype=torch.float64))
    x, err = balanced._solve_within(seq, k, goal, lo, hi, None, torch.arange(rows))
    assert bool(((x >= lo) & (x <= hi)).all())
    assert torch.allclose(err, (seq.held(x, k) - goal).abs())
    grid = lo[:, None] + (hi - lo)[:, None] * torch.arange(balanced.REPAIR_GRID + 1) // balanced.REPAIR_GRID
    off = seq.held(grid.flatten(), k.repeat_interleave(grid.shape[1])).view(grid.shape) - goal[:, None]
    crosses = ((off[:, :-1] < 0) & (off[:, 1:] >= 0)).any(1)
    row_work = float(layout.lengths.max())  # no row sees more keys
    assert bool((err[crosses] <= row_work).all())
    assert bool((err[~crosses] <= off[~crosses].abs().min(1).values + 1e-6).all())
    assert bool(crosses.any()) and bool((~crosses).any())


def test_balanced_at_scale_needs_no_bisection(monkeypatch):
    """4096 tokens per rank of the lognormal mix (1M over 256 ranks, 4M over 1024): the first
    sequence plans balance, so the search never runs its bisection (which took 4-5x as long)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the bisection ran")
    monkeypatch.setattr(balanced, "_bisection_plans", refuse)
    for tokens, n in ((1 << 20, 256), (1 << 22, 1024)):
        p = plan(DocLayout.from_lengths(workloads.layout("lognormal", tokens, 0)), n)
        assert p.stats().imbalance <= 1.01


def test_late_heads_keep_each_big_document_in_a_group_of_its_own():
    """Two documents of 38k and 35k tokens over 4 ranks (1.97 and 1.65 ranks' work; pretrain layout
    1): with every head split off at the start, ranks 0-1 took the 38k one and the 35k one's head
    (0.261 of an all-gather); heads split off only in groups of two put each document on two
    ranks, head + tail on one of them."""
    from doccp.app import workloads
    layout = DocLayout.from_lengths(workloads.layouts("pretrain", 131072, 8)[1])
    s = plan(layout, 4).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.21, s.kv_recv  # early heads only: 0.261


def test_bisection_plan_balances_the_seeded_mixes():
    """On every seeded mix at odd and even N, the bisection planner alone reaches the balance
    target (it is one candidate of ``balanced``, scored like the others)."""
    from doccp.app import workloads
    from doccp.plan import Plan
    mask = Mask.causal()
    for mix in workloads.MIXES:
        for n in (3, 8, 13):
            layout = DocLayout.from_lengths(workloads.layout(mix, 32768, n))
            pieces = balanced._bisection_plan(layout, n, mask, _whole(layout, n, mask)).stream_normalized()
            s = Plan(layout, n, mask, "balanced", pieces).stats()
            assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1, (mix, n, s.imbalance)


def test_balanced_with_few_tokens_per_rank():
    """128 ranks of 256 tokens, documents of ~700 (most cut): one sequence over all ranks left some
    rank receiving 57% of an all-gather; the bisection keeps every document on a few ranks."""
    from doccp.app import workloads
    layout = DocLayout.from_lengths(workloads.layout("lognormal", 32768, 1))
    s = plan(layout, 128).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.2, s.max_kv_fraction



def test_balanced_searches_in_inference_mode_and_returns_ordinary_tensors(monkeypatch):
    """The search runs under ``torch.inference_mode`` (less dispatch overhead per op), but its plan
    comes out as ordinary tensors: autograd may save them and code may update them in place,
    neither of which an inference tensor allows. Planning inside a caller's inference mode works too."""
    seen = []
    search = balanced._search
    monkeypatch.setattr(balanced, "_search", lambda *a: seen.append(torch.is_inference_mode_enabled()) or search(*a))
    layout = DocLayout.from_lengths([37, 5, 64, 22, 0, 1])
    pieces = balanced.balanced(layout, 3, Mask.causal())
    assert seen == [True]
    assert not any(c.is_inference() for c in (pieces.rank, pieces.doc, pieces.start, pieces.end))
    x = torch.randn(int(pieces.end.max()), requires_grad=True)
    x.index_select(0, pieces.start).sum().backward()  # autograd saves the index
    assert x.grad.sum() == len(pieces)
    pieces.start.add_(0)  # in place, outside inference mode
    with torch.inference_mode():
        inside = plan(layout, 3).stream_pieces
    assert torch.equal(inside.start, plan(layout, 3).stream_pieces.start)


def test_nested_parts_sized_for_lighter_fills(monkeypatch):
    """Pretrain mix, 32k tokens over 2 ranks: one document too big to stay whole. Sized for the
    other documents' mean work per token, its nested parts leave the outer rank room for too little
    of it; sized for lighter fills too (the lightest documents fill that rank up), the plan
    receives 0.250 of an all-gather instead of 0.295, still balanced. (The two-rank candidate is
    off: its plan, 0.245, wins here.)"""
    layout = DocLayout.from_lengths(workloads.layout("pretrain", 32768, 3))
    assert plan(layout, 2).stats().max_kv_fraction <= 0.245
    monkeypatch.setattr(balanced, "TWO_RANKS_KV", float("inf"))
    monkeypatch.setattr(trims, "TRIM_RANKS", 0)  # (and the trimmed packing: 0.247)
    s = plan(layout, 2).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.26, s.kv_recv
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balanced, "NESTED_FILLS", (1.0,))
        assert plan(layout, 2).stats().max_kv_fraction == pytest.approx(0.2947, abs=0.0005)


def test_nested_parts_mirrored_keep_the_outermost_holder_off_the_cut_documents(unpolished):
    """Pareto mix, 131k tokens over 3 ranks, layout 5: pinned from rank 0, the outermost holder of
    the big document's parts (which receives the most of it) is also the rank that takes the last
    rows of the densest documents the sequence cuts; mirrored, from rank 2 down, the two receivers
    part: 0.079 of an all-gather instead of 0.112."""
    layout = DocLayout.from_lengths(workloads.layout("pareto", 131072, 5))
    s = plan(layout, 3).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.08, s.kv_recv
    whole = _whole(layout, 3, Mask.causal())
    big = int(torch.nonzero(~whole & (layout.lengths > 0)).flatten()[0])
    p = plan(layout, 3).stream_pieces
    last = p.select((p.doc == big) & (p.end == layout.lengths[big]))
    assert last.rank.tolist() == [2]  # the outermost holder: the last rank
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balanced, "NESTED_MIRRORED", (False,))
        m.setattr(balanced, "_packed_around_nested", lambda *args: [])  # (unmirrored parts, packed: 0.1062)
        assert plan(layout, 3).stats().max_kv_fraction == pytest.approx(0.1119, abs=0.0005)


def test_nested_parts_of_the_heaviest_alone_where_all_do_not_fit(unpolished):
    """Long mix #1 over 4 ranks: two documents of 2.4 and 1.7 ranks' work, which do not fit nested
    on ranks of their own (5 ranks' worth). The heaviest one's nested parts alone, the other shared
    out around them by the sequence: 0.611 of an all-gather instead of 0.663, still balanced."""
    layout = DocLayout.from_lengths(workloads.layouts("long", 131072, 8)[1])
    mask, n = Mask.causal(), 4
    whole, work = _whole(layout, n, mask), mask.row_work(0, layout.lengths, layout.lengths)
    big = torch.nonzero(~whole & (layout.lengths > 0)).flatten()
    heaviest = sorted(big.tolist(), key=lambda d: -int(work[d]))
    assert len(heaviest) == 2 and balanced._nested_plan(layout, n, mask, whole, work, heaviest) is None
    alone = balanced._nested_plan(layout, n, mask, whole, work, heaviest[:1])
    s = plan(layout, n).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert max(s.kv_recv) == alone[1][1] and s.max_kv_fraction <= 0.612, s.max_kv_fraction
    p = plan(layout, n).stream_pieces
    assert len(set(p.rank[p.doc == heaviest[1]].tolist())) > 1  # the other one shared out, cut
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balanced, "_nested_plan", lambda *args, **kwargs: None)
        assert plan(layout, n).stats().max_kv_fraction == pytest.approx(0.6628, abs=0.0005)


def test_nested_parts_of_several_documents_on_ranks_of_their_own(monkeypatch, unpolished):
    """Pareto mix, 32k tokens over 4 ranks: two documents too big to stay whole. Their nested parts
    pinned together, the heavier one's from rank 0 and the other's from the rank after its last (or
    all mirrored, from rank N - 1 down): the plan receives 0.061 of an all-gather instead of 0.108,
    still balanced. (The trimmed packing is off: its runs receive a little less here.)"""
    monkeypatch.setattr(trims, "TRIM_RANKS", 0)
    layout = DocLayout.from_lengths(workloads.layout("pareto", 32768, 0))
    whole, work = _whole(layout, 4, Mask.causal()), Mask.causal().row_work(0, layout.lengths, layout.lengths)
    big = torch.nonzero(~whole & (layout.lengths > 0)).flatten()
    assert big.numel() == 2
    s = plan(layout, 4).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.065, s.kv_recv
    p = plan(layout, 4).stream_pieces
    heavier, lighter = sorted(big.tolist(), key=lambda d: -int(work[d]))
    ranks = [set(p.rank[p.doc == d].tolist()) for d in (heavier, lighter)]
    # each on ranks of its own, the heavier first from one end
    assert min(ranks[1]) > max(ranks[0]) or max(ranks[1]) < min(ranks[0]), ranks
    assert 0 in ranks[0] or 3 in ranks[0], ranks
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balanced, "NESTED_DOCS", 1)
        assert plan(layout, 4).stats().max_kv_fraction == pytest.approx(0.1084, abs=0.0005)


polish_module = importlib.import_module("doccp.plan.polish")
plan_package = importlib.import_module("doccp.plan")


def test_polish_trades_rows_between_two_ranks():
    """The module docstring's example, by hand: a 100- and a 60-token document over 2 ranks. Rank 0
    holds A's head and tail and B's head and receives A's middle (50 keys), rank 1 receives A's head
    and B's head (46). Moving A's head boundary up by 16 and B's boundary down by 16 gives rank 0 A's
    rows 16-31 (work 392) for B's rows 14-29 (360): it receives 34, within the cap; rank 1 still 46."""
    layout = DocLayout.from_lengths([100, 60])
    before = Pieces.of([0, 1, 0, 0, 1], [0, 0, 0, 1, 1], [0, 16, 66, 0, 30], [16, 66, 100, 30, 60])
    assert Plan(layout, 2, Mask.causal(), "balanced", before).kv_received == [50, 46]
    after = polish_module.polish(before, 2, 1.01 * 3440)
    polished = Plan(layout, 2, Mask.causal(), "balanced", after.stream_normalized())
    assert polished.pieces(0) == [(0, 0, 32), (0, 66, 100), (1, 0, 14)]
    assert polished.pieces(1) == [(0, 32, 66), (1, 14, 60)]
    assert polished.kv_received == [34, 46] and polished.work == [3472, 3408]
    # a cap below 3472 allows only part of the shift: rank 0 then receives more than 34
    tight = Plan(layout, 2, Mask.causal(), "balanced", polish_module.polish(before, 2, 3460).stream_normalized())
    assert max(tight.work) <= 3460 and 34 < tight.kv_received[0] <= 46


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), min_size=2, max_size=14),
       st.dictionaries(st.integers(0, 12), st.integers(-9, 9), max_size=4), st.integers(0, 5), st.integers(0, 5))
def test_polish_scores_a_move_from_the_two_ranks_pieces_alone(runs, shifts, top, other):
    """A move's KV is read from the pieces of its two ranks and its validity from the pieces next to
    a moved boundary (not every piece of the document: a long one cut over 64 ranks has 127): the
    same figures, and the same refusals, as one pass over all of them."""
    parts, at = [], 0
    for rank, length in runs:  # a document's pieces in row order (touching ones of a rank merged)
        if parts and parts[-1][0] == rank:
            parts[-1][2] += length
        else:
            parts.append([rank, at, at + length])
        at += length
    shifts = {i: shift for i, shift in shifts.items() if i < len(parts) - 1}
    ranks = (top, other)

    def every_piece():
        top_row, own = dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)
        for i, (r, a, b) in enumerate(parts):
            a, b = a + shifts.get(i - 1, 0), b + shifts.get(i, 0)
            if b < a:
                return None
            if r in top_row and b > a:
                top_row[r], own[r] = max(top_row[r], b), own[r] + b - a
        return {r: top_row[r] - own[r] for r in ranks}

    pieces_of: dict[int, list[int]] = {}
    for i, (r, _, _) in enumerate(parts):
        pieces_of.setdefault(r, []).append(i)
    assert polish_module._received_shifted(parts, shifts, ranks, pieces_of) == every_piece()


def test_polish_keeps_tokens_cuts_and_balance_and_never_raises_the_max_kv():
    """On the search's own plans of small batches of every mix (2-8 ranks): a polished plan still
    tiles the stream, gives every rank the same tokens, cuts no document the plan did not cut, keeps
    every rank's work within the cap and receives at most the plan's max KV; on most layouts less."""
    mask, lowered = Mask.causal(), 0
    for mix in workloads.MIXES:
        for index in range(3):
            lengths = workloads.layout(mix, 8192, index)
            layout = DocLayout.from_lengths(lengths)
            for n in (2, 3, 5, 8):
                with pytest.MonkeyPatch.context() as m:
                    m.setattr(balanced, "polish", lambda pieces, n, cap: pieces)
                    before = plan(layout, n)
                cap = 1.01 * sum(before.work) / n
                after = Plan(layout, n, mask, "balanced",
                             polish_module.polish(before.stream_pieces, n, cap).stream_normalized())
                assert plan_package._partitions(after), (mix, index, n)
                assert after.local_sizes == before.local_sizes
                assert max(after.work) <= max(cap, max(before.work))
                assert max(after.kv_received) <= max(before.kv_received)
                cut = [{d for d, k in Counter(p.stream_pieces.doc.tolist()).items() if k > 1} for p in (before, after)]
                assert cut[1] <= cut[0]
                lowered += max(after.kv_received) < max(before.kv_received)
    assert lowered >= 10, lowered


def test_balanced_polishes_its_plan(unpolished):
    """Long mix #1 over 4 ranks (two documents of 2.4 and 1.7 ranks' work): the search's plan
    receives 0.611 of an all-gather; polished, 0.566 or less (the bound: 0.556), still balanced."""
    layout = DocLayout.from_lengths(workloads.layouts("long", 131072, 8)[1])
    assert plan(layout, 4).stats().max_kv_fraction == pytest.approx(0.6108, abs=0.0005)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balanced, "polish", polish_module.polish)
        s = plan(layout, 4).stats()
    assert s.imbalance <= 1.01 and max(s.tokens) - min(s.tokens) <= 1
    assert s.max_kv_fraction <= 0.566, s.max_kv_fraction


def test_polish_gives_a_whole_document_for_rows_of_a_cut_one():
    """Lengths 2, 13, 8, 3, 8 and 1 over 3 ranks: rank 1 receives 8 keys (5 of the 13-token document,
    3 of the 8-token one, whose first 3 rows rank 2 holds). It gives its whole 3-token document to
    rank 2 for those 3 rows (6 pairs each way): it then holds the document's first 5 rows and
    receives 5, as every rank does; the 8-token document is cut in two pieces, not three."""
    layout = DocLayout.from_lengths([2, 13, 8, 3, 8, 1])
    before = Pieces.of([1, 2, 1, 2, 0, 1, 2, 1, 0, 0], [0, 1, 1, 1, 2, 3, 4, 4, 4, 5],
                       [0, 0, 5, 10, 0, 0, 0, 3, 5, 0], [2, 5, 10, 13, 8, 3, 3, 5, 8, 1])
    original = Plan(layout, 3, Mask.causal(), "balanced", before)
    assert original.kv_received == [5, 8, 5] and original.work == [58, 58, 57]
    after = Plan(layout, 3, Mask.causal(), "balanced",
                 polish_module.polish(before, 3, 1.01 * 173 / 3).stream_normalized())
    assert after.pieces(0) == original.pieces(0)
    assert after.pieces(1) == [(0, 0, 2), (1, 5, 10), (4, 0, 5)]
    assert after.pieces(2) == [(1, 0, 5), (1, 10, 13), (3, 0, 3)]
    assert after.kv_received == [5, 5, 5] and after.work == [58, 58, 57]


def test_balanced_polish_below_the_gain_keeps_the_balance():
    """Lognormal, 1M tokens over 64 ranks: a polish within the tolerance saves under 1% of the max
    KV (30 of 6074 keys, for an imbalance of 1.0039 -> 1.0098), so the plan is polished within its
    own busiest rank's work instead: fewer keys, the same max work."""
    layout = DocLayout.from_lengths(workloads.layout("lognormal", 1 << 20, 0))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balanced, "polish", lambda pieces, n, cap: pieces)
        before = plan(layout, 64).stats()
    after = plan(layout, 64).stats()
    assert max(after.kv_recv) < max(before.kv_recv) and max(after.kv_recv) > 0.99 * max(before.kv_recv)
    assert max(after.work) <= max(before.work)
