"""Distributed CP attention vs the float64 single-process oracle, on real gloo groups."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from oracle import assert_rank_matches, dense_attention, expect_errors, random_lengths

import doccp
from doccp import DocLayout, Mask, comm
from doccp.algorithms import predicted_bytes
from doccp.algorithms.registry import Shapes
from doccp.launch import WorkerError, spawn

MASKS = [Mask.causal(), Mask.full(), Mask.sliding_window(5), Mask.sliding_window(4, 3), Mask.chunked(6)]
STRATEGIES = ["contiguous", "head_tail", "balanced"]
ALGORITHMS = ["allgather", "ring_kv"]
HQ, HKV, D = 4, 1, 16  # GQA 4:1


def layouts(world_size: int) -> list[list[int]]:
    rng = random.Random(world_size)
    return [
        random_lengths(rng, 9, 40),  # zero-length, 1-token, short documents
        [0, 3 * world_size + 1, 0],  # one document spanning (almost) everything
        [1] * (2 * world_size + 1),  # only 1-token documents; T % N != 0
        [2 * world_size - 1, 57, 5, 0, 33],  # documents shorter than 2N
    ]


def full_inputs(layout: DocLayout, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = layout.num_tokens
    q, k, v, dout = (torch.randn(t, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))
    return q, k, v, dout


def run_cases(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """Worker: every case on this rank; returns the local results and bytes received."""
    results = []
    for lengths, strategy, mask, algorithm, seed in cases:
        layout = DocLayout.from_lengths(lengths)
        plan = doccp.plan(layout, world_size, mask, strategy)
        q, k, v, dout = (doccp.shard(x.float(), plan, rank).requires_grad_() for x in full_inputs(layout, seed))
        with comm.measure() as fwd:
            out, lse = doccp.attention(q, k, v, plan, algorithm=algorithm, return_lse=True)
        out.backward(dout.detach())
        results.append({"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
                        "recv": fwd.received, "nan": any(torch.isnan(t).any() for t in (out, q.grad, k.grad))})
    return results


def check(results_per_rank, cases, world_size):
    for i, (lengths, strategy, mask, algorithm, seed) in enumerate(cases):
        layout = DocLayout.from_lengths(lengths)
        plan = doccp.plan(layout, world_size, mask, strategy)
        q, k, v, dout = full_inputs(layout, seed)
        q, k, v = (x.float().double().requires_grad_() for x in (q, k, v))
        ref_out, ref_lse = dense_attention(q, k, v, layout, mask)
        ref_out.backward(dout.float().double())
        predicted = predicted_bytes(plan, algorithm, Shapes(HQ, HKV, D, 4))
        what = f"case {i}: lengths={lengths} N={world_size} {strategy} {mask} {algorithm}"
        for r in range(world_size):
            got = results_per_rank[r][i]
            idx = plan.indices(r)
            assert not got["nan"], what
            assert_rank_matches(got, ref_out, ref_lse, (q.grad, k.grad, v.grad), idx, what)
            assert got["recv"] == predicted[r], f"{what}: bytes received on rank {r}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_attention_matches_reference(world_size):
    cases = [(lengths, strategy, mask, algorithm, seed)
             for seed, (lengths, strategy, mask, algorithm) in enumerate(
                 itertools.product(layouts(world_size), STRATEGIES, MASKS, ALGORITHMS))]
    check(spawn(run_cases, world_size, world_size, cases), cases, world_size)


@pytest.mark.parametrize("world_size", [8, 13])
def test_attention_many_ranks(world_size):
    """More ranks than the cases above: every peer of a rank in the exchange, a ring of 13 hops."""
    lengths = [100, 3, 0, 41, 7, 1, 250, 2 * world_size - 1]
    cases = [(lengths, "balanced", Mask.causal(), algorithm, i) for i, algorithm in enumerate(ALGORITHMS)]
    cases += [(lengths, "head_tail", Mask.sliding_window(9), "ring_kv", 7)]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


def run_subgroup(rank: int) -> dict | None:
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    layout = DocLayout.from_lengths([30, 0, 17, 5])
    plan = doccp.plan(layout, 2, Mask.causal(), "head_tail")
    me = dist.get_rank(group)
    q, k, v, dout = (doccp.shard(x.float(), plan, me).requires_grad_() for x in full_inputs(layout, 0))
    results = {}
    for algorithm in ALGORITHMS:
        q.grad = k.grad = v.grad = None
        out = doccp.attention(q, k, v, plan, group=group, algorithm=algorithm)
        out.backward(dout)
        results[algorithm] = (out.detach(), q.grad, k.grad, v.grad)
    return {"me": me, **results}


def test_subgroup_of_world_3():
    results = spawn(run_subgroup, 3)
    assert results[0] is None
    layout = DocLayout.from_lengths([30, 0, 17, 5])
    plan = doccp.plan(layout, 2, Mask.causal(), "head_tail")
    q, k, v, dout = full_inputs(layout, 0)
    q, k, v = (x.float().double().requires_grad_() for x in (q, k, v))
    ref, _ = dense_attention(q, k, v, layout, Mask.causal())
    ref.backward(dout.float().double())
    for res in results[1:]:
        idx = plan.indices(res["me"])
        for algorithm in ALGORITHMS:
            out, dq, dk, dv = res[algorithm]
            torch.testing.assert_close(out.double(), ref[idx].detach(), atol=2e-5, rtol=0)
            for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
                torch.testing.assert_close(got.double(), want[idx], atol=1e-4, rtol=0)


def run_bad_input(rank: int, world_size: int) -> list[str]:
    """Each bad call must raise on every rank (no hang); returns the messages seen."""
    layout = DocLayout.from_lengths([10, 7, 0, 12])
    plan = doccp.plan(layout, world_size)
    x = torch.randn(layout.num_tokens, 4, 8)
    q, k, v = (doccp.shard(t, plan, rank) for t in (x, x[:, :2], x[:, :2]))
    wrong_plan = doccp.plan(layout, world_size + 1)
    calls = {
        "plan/group size": lambda: doccp.attention(q, k, v, wrong_plan),
        "shape on rank 1 only": lambda: doccp.attention(q if rank != 1 else q[1:], k, v, plan),
        "devices": lambda: doccp.attention(q, k.to("meta"), v, plan),
        "heads": lambda: doccp.attention(q[:, :3], k, v, plan),
        "algorithm": lambda: doccp.attention(q, k, v, plan, algorithm="zigzag"),
    }
    messages = expect_errors(calls, rank)
    return messages


def test_bad_input_raises_on_every_rank():
    results = spawn(run_bad_input, 2, 2, timeout_s=60)
    for messages in results:
        assert len(messages) == 5
        assert "world_size=3" in messages[0] and "2 ranks" in messages[0]
        assert "rank 1" in messages[1]
        assert "one device" in messages[2]
        assert "multiple of the number of KV heads" in messages[3]
        assert "algorithm must be" in messages[4]


def test_single_process_without_group_matches_reference():
    layout = DocLayout.from_lengths([5, 0, 9])
    plan = doccp.plan(layout, 1)
    q, k, v, _ = full_inputs(layout, 3)
    out = doccp.attention(q.float(), k.float(), v.float(), plan)
    ref, _ = dense_attention(q, k, v, layout, Mask.causal())
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


def fail_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("boom")
    return rank


def test_worker_errors_name_the_rank():
    with pytest.raises(WorkerError, match="rank 1 raised ValueError: boom"):
        spawn(fail_on_rank_1, 2)


def test_auto_rule_prefers_allgather_on_cpu_and_weighs_volume_on_gpu():
    from doccp.algorithms import choose_algorithm

    split = doccp.plan(DocLayout.from_lengths([100, 50, 7]), 2, strategy="head_tail")
    shapes = Shapes(HQ, HKV, D, 2)
    assert choose_algorithm(split, shapes, "cpu") == "allgather"  # gloo hops do not overlap compute
    assert choose_algorithm(split, shapes, "cuda") == "ring_kv"  # ring volume == all-gather volume here
    whole = doccp.plan(DocLayout.from_lengths([5, 5]), 2, strategy="contiguous")
    assert choose_algorithm(whole, shapes, "cuda") == "allgather"  # nothing to move at all


def test_attention_balanced_plans_odd_world():
    """Plans of the balanced planner (packed whole documents, chain cuts) at odd N, with
    zero-length and 1-token documents and fewer tokens than ranks."""
    rng = random.Random(3)
    many = [rng.choice([0, 1, rng.randint(2, 30)]) for _ in range(24)]
    big = [60, 4, 200, 1, 0, 140]  # documents longer than a rank: cut into runs over adjacent ranks
    cases = [(lengths, "balanced", mask, algorithm, i) for i, (lengths, mask, algorithm) in enumerate(
        itertools.product([many, [1, 0, 1], big], [Mask.causal(), Mask.sliding_window(4, 3), Mask.chunked(16)],
                          ALGORITHMS))]
    check(spawn(run_cases, 3, 3, cases, threads=1), cases, 3)


def _from_bisection(lengths: list[int], n: int, mask: Mask, late: bool | None = None) -> bool:
    """Whether ``balanced`` takes the recursive bisection planner's plan for this layout (with
    ``late``, one of its late-head variants, or only others)."""
    import importlib
    balanced = importlib.import_module("doccp.plan.balanced")
    layout = DocLayout.from_lengths(lengths)
    work = mask.pairs(0, layout.lengths, 0, layout.lengths)
    whole = (layout.lengths <= -(-layout.num_tokens // n)) & (work.double() <= float(work.sum()) / n)
    theirs = doccp.plan(layout, n, mask).stream_pieces
    for (head_back, late_heads), window in itertools.product(balanced.BISECT_HEAD_BACK, balanced.BISECT_WINDOW):
        if late is not None and late_heads != late:
            continue
        ours = balanced._bisection_plan(layout, n, mask, whole, head_back, window, late_heads).stream_normalized()
        if len(ours) == len(theirs) and all(bool((getattr(ours, f) == getattr(theirs, f)).all())
                                            for f in ("rank", "doc", "start", "end")):
            return True
    return False


@pytest.mark.parametrize("world_size, lengths, masks, late", [
    (3, [1, 87, 74, 1, 0], [Mask.causal(), Mask.chunked(16)], None),
    (5, [53, 58, 1, 0, 1, 0, 62], [Mask.causal(), Mask.sliding_window(4, 3)], None),
    (3, [5, 0, 5, 72, 8, 87, 3, 3, 5, 1], [Mask.causal()], True),
    (5, [78, 0, 77, 2, 77, 2, 1], [Mask.chunked(16)], True),
])
def test_attention_bisection_plans(world_size, lengths, masks, late):
    """Plans of the recursive bisection (big documents on groups of ranks, heads and tails
    together; ``late``: heads split off only in groups of two ranks) at odd N, with zero-length
    and 1-token documents. (The search's plans are the bisection's; the ranks run them polished,
    doccp.plan.polish, which only shifts their cuts.)"""
    with pytest.MonkeyPatch.context() as m:
        _unpolished(m)
        assert all(_from_bisection(lengths, world_size, mask, late) for mask in masks)  # the plans under test
    cases = [(lengths, "balanced", mask, algorithm, i)
             for i, (mask, algorithm) in enumerate(itertools.product(masks, ALGORITHMS))]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


def _unpolished(monkeypatch) -> None:
    """The balanced search's plans as it leaves them, in this process: the polish off."""
    import importlib
    monkeypatch.setattr(importlib.import_module("doccp.plan.balanced"), "polish", lambda pieces, n, cap: pieces)


def _assert_not_trimmed(monkeypatch, layout: DocLayout, n: int, masks: list[Mask]) -> None:
    """The balanced plans of ``layout`` are the same with the trimmed packing (doccp.plan.trims)
    off: the candidate a test means to run is the one the spawned ranks plan."""
    import importlib
    plans = [doccp.plan(layout, n, mask).stream_pieces for mask in masks]
    with monkeypatch.context() as m:
        m.setattr(importlib.import_module("doccp.plan.trims"), "TRIM_RANKS", 0)
        for mask, ours in zip(masks, plans, strict=True):
            theirs = doccp.plan(layout, n, mask).stream_pieces
            assert all(torch.equal(getattr(ours, f), getattr(theirs, f)) for f in ("rank", "doc", "start", "end"))


@pytest.mark.parametrize("world_size, lengths, masks, without", [
    (2, [20, 52, 1, 0, 1, 12, 36, 7, 36, 2, 20, 29, 2, 12, 5], [Mask.causal()], ("PACK_RANKS", 0)),
    (3, [12, 31, 0, 7, 31, 3, 0, 0, 1, 20, 12, 7, 31, 20, 3, 3], [Mask.causal(), Mask.sliding_window(5)],
     ("PACK_RANKS", 0)),
    (2, [5, 8, 5, 1, 40, 8, 5, 1, 1, 0], [Mask.causal()], ("PACK_HEAD_RESERVE", ())),
    (3, [12, 2, 0, 1, 36, 1, 7], [Mask.causal()], ("PACK_HEAD_RESERVE", ())),
    (3, [13, 5, 13, 23, 13, 1, 0, 3, 8, 5, 8], [Mask.causal()], ("PACK_HOSTED_RESERVE", ())),
    (4, [12, 3, 27, 0, 20, 1, 20, 1, 7], [Mask.causal()], ("PACK_HOSTED_RESERVE", ())),
], ids=["packing-2", "packing-3", "head-back-packing-2", "head-back-packing-3", "hosted-packing-3",
        "hosted-packing-4"])
def test_attention_packed_plans(monkeypatch, world_size, lengths, masks, without):
    """Plans of the balanced planner's packings (whole documents pinned to ranks, a reserve of
    short ones shared out; then with a big document's head at the back, so each rank holds a run of
    its tail and one of its head; last two: the big documents hosted by as few ranks as their work
    needs) at even and odd N, with zero-length and 1-token documents."""
    import importlib
    balanced = importlib.import_module("doccp.plan.balanced")
    layout = DocLayout.from_lengths(lengths)
    packed = [max(doccp.plan(layout, world_size, mask).stats().kv_recv) for mask in masks]
    assert all(doccp.plan(layout, world_size, mask).stats().imbalance <= 1.01 for mask in masks)  # balanced plans
    _assert_not_trimmed(monkeypatch, layout, world_size, masks)
    with monkeypatch.context() as m:
        m.setattr(balanced, "_nested_plan", lambda *args, **kwargs: None)  # (it ties some of these packings)
        assert [max(doccp.plan(layout, world_size, mask).stats().kv_recv) for mask in masks] == packed
        m.setattr(balanced, *without)
        unpacked = [max(doccp.plan(layout, world_size, mask).stats().kv_recv) for mask in masks]
    assert all(a < b for a, b in zip(packed, unpacked, strict=True))  # the plans under test are such packings
    cases = [(lengths, "balanced", mask, algorithm, i)
             for i, (mask, algorithm) in enumerate(itertools.product(masks, ALGORITHMS))]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


@pytest.mark.parametrize("world_size, lengths, mirrored", [
    (3, [1, 13, 2, 3, 0, 93, 8, 1, 8, 3, 1, 1, 0], False),
    (4, [0, 21, 2, 251, 8, 2, 0, 21, 2, 21, 34, 21, 1], False),
    (5, [0, 1, 0, 120, 147, 0, 2, 13, 5, 5, 21, 0, 13, 1], True),
    (3, [0, 2, 13, 1, 0, 46, 8, 2], True),
    (5, [158, 3, 13, 21, 0, 1, 13, 0, 1, 0, 2, 13], True),
])
def test_attention_nested_plans(monkeypatch, world_size, lengths, mirrored):
    """Plans of the balanced planner that pin a big document's nested parts (each rank a head and
    a tail of what the ranks outside it left, the innermost the middle; doccp.plan.nested) and pack
    the rest around them, at odd and even N, with zero-length and 1-token documents; the third pins
    two such documents, each on ranks of its own; the last three pin them mirrored (from rank N - 1)."""
    import importlib
    balanced = importlib.import_module("doccp.plan.balanced")
    layout = DocLayout.from_lengths(lengths)
    nested = max(doccp.plan(layout, world_size).stats().kv_recv)
    with monkeypatch.context() as m:
        m.setattr(balanced, "NESTED_MIRRORED", (False,))
        assert (nested < max(doccp.plan(layout, world_size).stats().kv_recv)) == mirrored
        m.setattr(balanced, "_nested_plan", lambda *args, **kwargs: None)
        assert nested < max(doccp.plan(layout, world_size).stats().kv_recv)  # the plans under test are nested
    cases = [(lengths, "balanced", Mask.causal(), algorithm, i) for i, algorithm in enumerate(ALGORITHMS)]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


@pytest.mark.parametrize("world_size, lengths", [
    (4, [3, 99, 0, 127, 8, 3, 3, 1, 8]),
    (5, [2, 114, 1, 1, 1, 1, 3, 21, 2, 170, 9]),
    (3, [8, 200, 21, 196, 21, 0]),
])
def test_attention_nested_plans_of_the_heaviest_alone(monkeypatch, world_size, lengths):
    """Plans that pin the nested parts of the heaviest of two documents too big to stay whole and
    share out the other (the two do not fit nested on ranks of their own), odd and even N, with
    zero-length and 1-token documents."""
    import importlib
    balanced = importlib.import_module("doccp.plan.balanced")
    layout = DocLayout.from_lengths(lengths)
    every = balanced._nested_plan

    def all_or_none(layout, n, mask, whole, work, docs, *args, **kwargs):
        alone = len(docs) == 1 and int((~whole & (layout.lengths > 0)).sum()) > 1
        return None if alone else every(layout, n, mask, whole, work, docs, *args, **kwargs)

    with monkeypatch.context() as m:  # the search's plans (the ranks run them polished: cuts shifted)
        _unpolished(m)
        nested = max(doccp.plan(layout, world_size).stats().kv_recv)
        m.setattr(balanced, "_nested_plan", all_or_none)
        assert nested < max(doccp.plan(layout, world_size).stats().kv_recv)  # the plans under test
    cases = [(lengths, "balanced", Mask.causal(), algorithm, i) for i, algorithm in enumerate(ALGORITHMS)]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


@pytest.mark.parametrize("world_size, lengths", [
    (3, [2, 5, 130, 163]),
    (4, [1, 2, 5, 187, 181, 1]),
    (5, [1, 161, 1, 184]),
    (4, [55, 0, 83, 8, 0, 0, 1]),
])
def test_attention_opposed_plans(monkeypatch, world_size, lengths):
    """Plans that nest two documents too big to stay whole from opposite ends, sharing a rank (the
    second's head maybe on a rank of the first; doccp.plan.nested.opposed_parts), odd and even N,
    with zero-length and 1-token documents."""
    import importlib
    balanced = importlib.import_module("doccp.plan.balanced")
    layout = DocLayout.from_lengths(lengths)
    every = balanced._nested_plan
    opposed = max(doccp.plan(layout, world_size).stats().kv_recv)
    with monkeypatch.context() as m:
        m.setattr(balanced, "_nested_plan", lambda *args, **kwargs: None if kwargs.get("opposed")
                  else every(*args, **kwargs))
        assert opposed < max(doccp.plan(layout, world_size).stats().kv_recv)  # the plans under test
    cases = [(lengths, "balanced", Mask.causal(), algorithm, i) for i, algorithm in enumerate(ALGORITHMS)]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


@pytest.mark.parametrize("lengths", [[90, 8, 5, 2, 2, 0, 8, 60, 31, 90, 1], [60, 0, 20, 0, 2, 60, 3, 1, 3]])
def test_attention_two_rank_plans(monkeypatch, lengths):
    """Plans of the balanced planner's two-rank candidate (doccp.plan.two_ranks: one document's
    head and tail on one rank, its middle on the other, beside whole documents a local search
    picks), with zero-length and 1-token documents."""
    import importlib
    balanced = importlib.import_module("doccp.plan.balanced")
    layout = DocLayout.from_lengths(lengths)
    assert doccp.plan(layout, 2).stats().imbalance <= 1.01
    _assert_not_trimmed(monkeypatch, layout, 2, [Mask.causal()])
    with monkeypatch.context() as m:  # the search's plans (the ranks run them polished: cuts shifted)
        _unpolished(m)
        s = doccp.plan(layout, 2).stats()
        m.setattr(importlib.import_module("doccp.plan.trims"), "TRIM_RANKS", 0)  # (it ties the first)
        m.setattr(balanced, "TWO_RANKS_KV", float("inf"))
        assert max(s.kv_recv) < max(doccp.plan(layout, 2).stats().kv_recv)  # the plans under test
    cases = [(lengths, "balanced", Mask.causal(), algorithm, i) for i, algorithm in enumerate(ALGORITHMS)]
    check(spawn(run_cases, 2, 2, cases, threads=1), cases, 2)


@pytest.mark.parametrize("world_size, lengths, masks, without", [
    (3, [34, 34, 13, 8, 13, 5, 8, 8, 21, 21, 3, 1, 0, 1, 5], [Mask.causal()], ("TRIM_RANKS", 0)),
    (3, [21, 2, 13, 8, 13, 34, 1, 34, 1, 1, 21, 5, 0, 89, 89], [Mask.sliding_window(5)], ("TRIM_RANKS", 0)),
    (4, [34, 5, 21, 21, 0, 21, 89, 1, 3, 5, 2, 8, 3, 21, 89, 34], [Mask.causal()], ("TRIM_RANKS", 0)),
    (4, [2, 21, 1, 2, 55, 5, 89, 0, 55, 89, 55, 21, 1, 3, 55], [Mask.sliding_window(5), Mask.chunked(16)],
     ("TRIM_RANKS", 0)),
    (5, [89, 89, 34, 55, 34, 21, 1, 55, 34, 55, 13, 0], [Mask.sliding_window(5)], ("TRIM_RANKS", 0)),
    (5, [3, 13, 34, 1, 3, 89, 0, 21, 21, 89, 3, 89, 55, 34], [Mask.causal()], ("TRIM_RANKS", 0)),
    # heads cut off beforehand
    (3, [8, 0, 34, 55, 5, 1, 5, 34, 34, 8, 55, 5, 8, 2, 13, 13, 55, 72, 34, 8], [Mask.causal()], ("HEADS", ())),
    (5, [1, 55, 34, 21, 55, 1, 1, 2, 55, 1, 21, 87, 8, 0, 34, 91, 5, 13, 89, 3, 2, 2, 34, 13, 2, 8],
     [Mask.causal()], ("HEADS", ())),
])
def test_attention_trimmed_plans(monkeypatch, world_size, lengths, masks, without):
    """Plans of the balanced planner's trimmed packing (doccp.plan.trims: whole documents packed by
    density, a run cut off the heaviest, what fits nowhere cut into the rooms left; heads cut off
    beforehand) at odd and even N, with zero-length and 1-token documents, under causal,
    sliding-window and chunked masks."""
    import importlib
    trims = importlib.import_module("doccp.plan.trims")
    layout = DocLayout.from_lengths(lengths)
    trimmed = [max(doccp.plan(layout, world_size, mask).stats().kv_recv) for mask in masks]
    assert all(doccp.plan(layout, world_size, mask).stats().imbalance <= 1.01 for mask in masks)
    with monkeypatch.context() as m:
        m.setattr(trims, *without)
        others = [max(doccp.plan(layout, world_size, mask).stats().kv_recv) for mask in masks]
    assert all(a < b for a, b in zip(trimmed, others, strict=True))  # the plans under test are these packings
    cases = [(lengths, "balanced", mask, algorithm, i)
             for i, (mask, algorithm) in enumerate(itertools.product(masks, ALGORITHMS))]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


# Layouts with documents of 80-95% of a rank's work among short ones (zero-length and 1-token too),
# where the planner hosts the heavy ones (found by a seeded search; each plan below receives less
# than the planner's without hosting).
HOSTED = [
    (3, [2, 72, 34, 34, 8, 5, 3, 55, 34, 5, 3, 2, 1, 34, 55], Mask.causal()),
    (3, [0, 5, 2, 3, 5, 13, 13, 3, 8, 2, 34, 0, 8, 2, 21, 13, 2, 1, 8, 2, 21, 1, 5, 5, 2, 3, 2, 34, 3, 13, 13, 1,
         1, 13, 66, 21, 21, 21, 5, 3, 2, 13, 8, 1, 5, 8, 0, 34, 1, 5, 13, 1, 3, 34, 1, 21, 34, 1, 21, 5, 8],
     Mask.causal()),
    (3, [8, 8, 2, 8, 8, 3, 3, 21, 2, 8, 5, 2, 13, 3, 0, 107, 8, 1, 5, 2, 1, 5, 2, 34, 1, 8, 0, 34, 21, 1, 3, 34,
         107, 21, 2, 34, 8, 0, 3, 34, 0], Mask.chunked(64)),
    (5, [1, 5, 2, 13, 34, 21, 3, 34, 2, 8, 8, 13, 2, 0, 1, 2, 8, 0, 1, 1, 0, 13, 34, 3, 0, 0, 1, 34, 21, 5, 13, 8,
         3, 34, 8, 1, 1, 8, 0, 2, 13, 13, 34, 13, 2, 3, 0, 8, 13, 69, 2, 13, 21, 0, 34, 21, 2, 3, 0, 8, 8, 13, 5,
         0, 13, 13, 2, 8, 2, 1, 13, 0, 5, 13, 34, 13, 0, 34, 21, 34, 5, 8, 13, 0, 5, 21, 3, 21, 2, 0, 21, 34, 3,
         21, 21, 0, 34, 3, 3, 13, 3], Mask.causal()),
]


@pytest.mark.parametrize("world_size, lengths, mask", HOSTED, ids=["causal-3-few", "causal-3", "chunked-3", "causal-5"])
def test_attention_hosted_plans(monkeypatch, world_size, lengths, mask):
    """Plans of the balanced planner's hosting (doccp.plan.hosts: heavy documents whole on ranks of
    their own, filled with whole documents and the heads every other rank cuts off its documents)."""
    import importlib
    hosts = importlib.import_module("doccp.plan.hosts")
    layout = DocLayout.from_lengths(lengths)
    s = doccp.plan(layout, world_size, mask).stats()
    assert s.imbalance <= 1.01
    with monkeypatch.context() as m:
        m.setattr(hosts, "HOST_SHARES", ())
        assert max(s.kv_recv) < max(doccp.plan(layout, world_size, mask).stats().kv_recv)  # the plans under test
    cases = [(lengths, "balanced", mask, algorithm, i) for i, algorithm in enumerate(ALGORITHMS)]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


NESTED_PACKED = [
    (3, [13, 1, 8, 13, 27, 0, 21, 3, 1, 3, 5]),
    (3, [1, 13, 13, 13, 8, 2, 1, 13, 0, 8, 8, 34, 0, 13, 3, 2, 34, 1, 5, 0, 0, 161, 0, 21, 0]),
    (5, [21, 13, 21, 2, 21, 99, 3, 21, 2, 13, 1, 8, 1, 8, 13, 5, 1, 2, 8, 1, 2, 79, 3, 1, 1, 5, 1, 3, 1, 13, 2, 1, 8,
         13, 1, 2, 1, 8, 21, 8, 5, 8]),
    (5, [0, 1, 8, 1, 3, 47, 0, 1, 3, 1, 34, 2, 1, 3, 1, 13, 0, 5, 21, 8, 3, 34, 1, 0, 21, 2]),
]


@pytest.mark.parametrize("world_size, lengths", NESTED_PACKED, ids=["3-small", "3", "5-two-big", "5"])
def test_attention_packed_around_nested_plans(monkeypatch, world_size, lengths):
    """Plans that nest the documents longer than a rank on ranks of their own and pack the others whole
    around them (doccp.plan.trims.packings_around), causal (the nesting's mask), at odd N, with
    zero-length and 1-token documents."""
    import importlib
    balanced = importlib.import_module("doccp.plan.balanced")
    layout = DocLayout.from_lengths(lengths)
    s = doccp.plan(layout, world_size).stats()
    assert s.imbalance <= 1.01
    with monkeypatch.context() as m:
        m.setattr(balanced, "_packed_around_nested", lambda *args: [])
        assert max(s.kv_recv) < max(doccp.plan(layout, world_size).stats().kv_recv)  # the plans under test
    cases = [(lengths, "balanced", Mask.causal(), algorithm, i) for i, algorithm in enumerate(ALGORITHMS)]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


@pytest.mark.parametrize("world_size, lengths", [(3, [1, 8, 0, 162, 0, 3]), (5, [243, 5, 0, 21, 1])], ids=["3", "5"])
def test_attention_plans_at_the_causal_floor(monkeypatch, world_size, lengths):
    """Plans the balanced search ends at because they receive the causal floor of their longest
    document (doccp.plan.bound.causal_floor), at odd N, with zero-length and 1-token documents."""
    import importlib
    balanced = importlib.import_module("doccp.plan.balanced")
    from doccp.plan.bound import causal_floor
    layout = DocLayout.from_lengths(lengths)
    with monkeypatch.context() as m:
        bisections = []
        solve = balanced._bisection_plans
        m.setattr(balanced, "_bisection_plans", lambda *args: bisections.append(1) or solve(*args))
        s = doccp.plan(layout, world_size).stats()
        assert s.imbalance <= 1.01 and max(s.kv_recv) == causal_floor(layout, world_size) and not bisections
        m.setattr(balanced, "causal_floor", lambda *args: 0)
        doccp.plan(layout, world_size)
        assert bisections  # without the floor the search goes on: the plans under test end it
    cases = [(lengths, "balanced", Mask.causal(), algorithm, i) for i, algorithm in enumerate(ALGORITHMS)]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


@pytest.mark.parametrize("world_size, lengths", [
    (3, [1, 1, 89, 0, 8, 144, 13]),
    (3, [21, 0, 0, 144, 1, 3, 1, 144]),
    (5, [1, 0, 1, 8, 55, 55, 144]),
])
def test_attention_polished_plans(monkeypatch, world_size, lengths):
    """Plans the polish changed (doccp.plan.polish: rows of cut documents traded between two ranks)
    at odd N, with zero-length and 1-token documents, causal (the polish runs under no other mask)."""
    import importlib
    balanced = importlib.import_module("doccp.plan.balanced")
    layout = DocLayout.from_lengths(lengths)
    s = doccp.plan(layout, world_size).stats()
    assert s.imbalance <= 1.01
    with monkeypatch.context() as m:
        m.setattr(balanced, "polish", lambda pieces, n, cap: pieces)
        assert max(s.kv_recv) < max(doccp.plan(layout, world_size).stats().kv_recv)  # the plans under test
    cases = [(lengths, "balanced", Mask.causal(), algorithm, i) for i, algorithm in enumerate(ALGORITHMS)]
    check(spawn(run_cases, world_size, world_size, cases, threads=1), cases, world_size)


def test_chunks_that_do_not_straddle_ranks_move_nothing():
    """A chunk needs only its own keys: cut at chunk boundaries, CP exchanges no KV at all, while
    a cut inside a chunk sends just that chunk's head."""
    layout = DocLayout.from_lengths([64, 32])
    aligned = doccp.plan(layout, 3, Mask.chunked(32), "contiguous")  # ranks hold [0,32) [32,64) [64,96)
    assert aligned.kv_received == [0, 0, 0]
    for name in ("allgather", "ring_kv"):
        assert predicted_bytes(aligned, name, Shapes(HQ, HKV, D, 4)) == [0, 0, 0]
    cut = doccp.plan(layout, 2, Mask.chunked(32), "contiguous")  # rank 1 starts at 48: mid-chunk
    assert cut.kv_received == [0, 16]


def test_allgather_attends_in_place_where_nothing_arrives():
    """A rank that receives nothing attends to its k and v as they are (no concatenated copy);
    whether it sends decides whether its dK/dV take the fp32 round trip for returned gradients.
    Exactness on such ranks is every contiguous and one-rank case above."""
    from doccp.algorithms.registry import schedule_of

    layout = DocLayout.from_lengths([40, 7, 30])
    contiguous = doccp.plan(layout, 3, Mask.causal(), "contiguous")  # rank 0 holds every head it sends
    flags = [(s.in_place, s.sends) for s in (schedule_of("allgather", contiguous, r) for r in range(3))]
    assert flags == [(True, True), (False, True), (False, False)]
    aligned = doccp.plan(DocLayout.from_lengths([64, 32]), 3, Mask.chunked(32), "contiguous")
    assert [(s.in_place, s.sends) for s in (schedule_of("allgather", aligned, r) for r in range(3))] == [
        (True, False)] * 3
    whole = doccp.plan(layout, 1)
    q, k, v, dout = (x.float().requires_grad_() for x in full_inputs(layout, 5))
    out = doccp.attention(q, k, v, whole, algorithm="allgather")
    saved = [t.data_ptr() for t in out.grad_fn.saved_tensors if t is not None]
    assert k.data_ptr() in saved and v.data_ptr() in saved  # the kernels read k and v themselves
    out.backward(dout)
    q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = dense_attention(q2, k2, v2, layout, Mask.causal())
    ref.backward(dout.detach().double())
    for got, want in ((out, ref), (q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
