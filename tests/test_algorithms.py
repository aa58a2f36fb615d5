"""Ulysses (all-to-all) and hybrid CP vs the float64 oracle, on real gloo groups.

One spawned group per world size runs every case of that size (spawning is the slow part):
masks x strategies x layouts with zero-length and 1-token documents and ranks without tokens,
GQA with KV heads split, or replicated when there are more ranks than KV heads, and the
hybrid on Ulysses groups made by ``HybridGroup.create`` and ``HybridGroup.from_mesh``.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from oracle import assert_rank_matches, dense_attention, expect_errors, random_lengths

import doccp
from doccp import DocLayout, Mask, comm
from doccp.algorithms import choose_algorithm, predicted_bytes
from doccp.algorithms.registry import Shapes
from doccp.launch import spawn

MASKS = [Mask.causal(), Mask.full(), Mask.sliding_window(5), Mask.sliding_window(4, 3), Mask.chunked(6)]
STRATEGIES = ["contiguous", "head_tail", "balanced"]
D = 8


class Case(NamedTuple):
    lengths: list[int]
    strategy: str
    mask: Mask
    algorithm: str
    heads: tuple[int, int]  # query heads, KV heads
    group: str | None  # None: the default group; else a key of GROUPS
    seed: int


#: Groups of 8 ranks split into two CP groups of 4 (data parallel 2 x CP 4).
DP2 = [[0, 1, 2, 3], [4, 5, 6, 7]]


def mesh_group(world_size: int, ulysses_size: int) -> doccp.HybridGroup:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size // ulysses_size, ulysses_size), mesh_dim_names=("across", "ulysses"))
    return doccp.HybridGroup.from_mesh(mesh)


#: The CP groups cases run on (every process of the world makes each, in the same order).
GROUPS = {
    "u2": lambda n: doccp.HybridGroup.create(2),
    "u4": lambda n: doccp.HybridGroup.create(4),
    "mesh u2": lambda n: mesh_group(n, 2),
    "dp2": lambda n: dist.new_subgroups_by_enumeration(DP2)[0],  # a plain CP group of 4 (of 8 ranks)
    "dp2 u2": lambda n: doccp.HybridGroup.create(2, cp_groups=DP2),  # each CP group of 4 as 2 x 2
}


def layouts(world_size: int) -> list[list[int]]:
    rng = random.Random(world_size)
    return [
        random_lengths(rng, 9, 30),  # zero-length, 1-token, short documents
        [0, 4 * world_size + 3, 0],  # one document over every rank
        [1, 0, 1] if world_size > 2 else [1],  # fewer tokens than ranks: ranks without tokens
    ]


def cases_for(world_size: int, algorithms: list[tuple[str, str | None]], heads: list[tuple[int, int]],
              masks: list[Mask] = MASKS, strategies: list[str] = STRATEGIES) -> list[Case]:
    return [Case(lengths, strategy, mask, algorithm, h, group, 0) for lengths, strategy, mask, (algorithm, group), h
            in itertools.product(layouts(world_size), strategies, masks, algorithms, heads)]


def full_inputs(layout: DocLayout, heads: tuple[int, int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    return [torch.randn(layout.num_tokens, h, D, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def run_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    """Worker: every case on this rank; local results, bytes received and predicted, CP rank and size."""
    groups = {spec: GROUPS[spec](world_size) for spec in sorted({c.group for c in cases if c.group})}
    results = []
    for c in cases:
        layout = DocLayout.from_lengths(c.lengths)
        group = groups.get(c.group)
        me, n = comm.rank(group), comm.size(group)
        plan = doccp.plan(layout, n, c.mask, c.strategy)
        q, k, v, dout = (doccp.shard(x.float(), plan, me).requires_grad_() for x in full_inputs(layout, c.heads,
                                                                                                 c.seed))
        with comm.measure() as fwd:
            out, lse = doccp.attention(q, k, v, plan, group=group, algorithm=c.algorithm, return_lse=True)
        out.backward(dout.detach())
        shapes = Shapes.of(q, k)
        ran = choose_algorithm(plan, shapes, q.device, group) if c.algorithm == "auto" else c.algorithm
        results.append({"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad, "me": me, "n": n,
                        "recv": fwd.received, "predicted": predicted_bytes(plan, ran, shapes, group)})
    return results


def check(results_per_rank: list[list[dict]], cases: list[Case], world_size: int) -> None:
    for i, c in enumerate(cases):
        layout = DocLayout.from_lengths(c.lengths)
        n = results_per_rank[0][i]["n"]
        plan = doccp.plan(layout, n, c.mask, c.strategy)
        q, k, v, dout = full_inputs(layout, c.heads, c.seed)
        q, k, v = (x.float().double().requires_grad_() for x in (q, k, v))
        ref_out, ref_lse = dense_attention(q, k, v, layout, c.mask)
        ref_out.backward(dout.float().double())
        what = f"case {i}: N={world_size} {c}"
        assert sorted(results[i]["me"] for results in results_per_rank) == sorted(list(range(n)) * (world_size // n))
        for r in range(world_size):  # a world rank; its CP rank in its CP group
            got = results_per_rank[r][i]
            me, idx = got["me"], plan.indices(got["me"])
            assert_rank_matches(got, ref_out, ref_lse, (q.grad, k.grad, v.grad), idx, what)
            assert got["recv"] == got["predicted"][me], f"{what}: bytes received on rank {r}"
            assert got["predicted"] == results_per_rank[0][i]["predicted"], f"{what}: ranks predict differently"


def spawn_and_check(world_size: int, cases: list[Case]) -> None:
    results = spawn(run_cases, world_size, world_size, cases, threads=1, timeout_s=60, deadline_s=300)
    check(results, cases, world_size)


def test_world_size_1():
    spawn_and_check(1, cases_for(1, [("ulysses", None)], [(4, 1)], strategies=["contiguous"]))


def test_world_size_2():
    # GQA 4:1 (the KV head replicated on both ranks) and 2:1 (one KV head each); every mask x strategy.
    cases = cases_for(2, [("ulysses", None)], [(4, 1)])
    cases += cases_for(2, [("ulysses", None)], [(4, 2)], masks=[Mask.causal(), Mask.chunked(6)],
                       strategies=["balanced"])
    spawn_and_check(2, cases)


def test_world_size_3():
    # 6 query heads, 3 KV heads split (2:1) or 1 replicated on 3 ranks (6:1).
    cases = cases_for(3, [("ulysses", None)], [(6, 1)], masks=[Mask.causal(), Mask.sliding_window(4, 3),
                                                              Mask.chunked(6)])
    cases += cases_for(3, [("ulysses", None)], [(6, 3)], masks=[Mask.full()], strategies=["balanced"])
    spawn_and_check(3, cases)


def test_world_size_4_ulysses_and_hybrid_2x2():
    # GQA 4:1 and 8:1 with more ranks than KV heads (replicas); hybrid 2 x 2 from groups and from a mesh.
    cases = cases_for(4, [("ulysses", None), ("hybrid", "u2")], [(4, 1)])
    cases += cases_for(4, [("ulysses", None), ("hybrid", "u2")], [(8, 1), (8, 4)], masks=[Mask.causal()],
                       strategies=["balanced"])
    cases += cases_for(4, [("hybrid", "mesh u2"), ("auto", "u2")], [(4, 2)], masks=[Mask.chunked(6)],
                       strategies=["head_tail"])
    spawn_and_check(4, cases)


def test_world_size_8_ulysses_and_hybrid_2x4():
    # GQA 8:1 (one KV head on 8 ranks) and 4:1; hybrid with Ulysses groups of 2 (x 4) and of 4 (x 2).
    long = [0, 37, 5, 1, 0, 60]
    cases = [Case(long, strategy, mask, algorithm, heads, group, 1) for strategy, (mask, heads), (algorithm, group)
             in itertools.product(["head_tail", "balanced"], [(Mask.causal(), (8, 1)), (Mask.chunked(6), (8, 2))],
                                  [("ulysses", None), ("hybrid", "u2"), ("hybrid", "u4")])]
    cases += [Case([1, 0, 2], "balanced", Mask.sliding_window(2, 1), algorithm, (8, 1), group, 2)
              for algorithm, group in [("ulysses", None), ("hybrid", "u2")]]
    # Data parallel 2 x CP 4: Ulysses on a process group of 4 of the 8 ranks, the hybrid 2 x 2 inside each.
    cases += [Case(long, "balanced", Mask.causal(), algorithm, (4, 2), group, 3)
              for algorithm, group in [("ulysses", "dp2"), ("hybrid", "dp2 u2")]]
    spawn_and_check(8, cases)


def run_bad_input(rank: int, world_size: int) -> list[str]:
    """Each bad call must raise the same error on every rank (no hang); returns the messages."""
    layout = DocLayout.from_lengths([10, 7, 0, 12])
    plan = doccp.plan(layout, world_size)
    x = doccp.shard(torch.randn(layout.num_tokens, 12, 8), plan, rank)
    hybrid = doccp.HybridGroup.create(2)

    def call(hq: int, hkv: int, algorithm: str, group: doccp.HybridGroup | None = None) -> None:
        doccp.attention(x[:, :hq], x[:, :hkv], x[:, :hkv], plan, group=group, algorithm=algorithm)

    calls = {
        "query heads not divisible": lambda: call(6, 1, "ulysses"),
        "KV heads not replicable": lambda: call(12, 3, "ulysses"),
        "hybrid heads": lambda: call(6, 3, "hybrid", hybrid),
        "hybrid without HybridGroup": lambda: call(4, 1, "hybrid"),
        "swapped groups": lambda: call(4, 1, "hybrid", doccp.HybridGroup(None, hybrid.across, hybrid.ulysses)),
    }
    return expect_errors(calls, rank)


def test_bad_heads_raise_the_same_error_on_every_rank():
    results = spawn(run_bad_input, 4, 4, timeout_s=60, deadline_s=120)
    # Ranks other than the one that found the problem say who reported it; the error is the same.
    results = [[re.sub(r" \(reported by rank \d+ of the group\)$", "", m) for m in messages] for messages in results]
    assert all(messages == results[0] for messages in results), results
    heads, kv, hybrid, no_group, swapped = results[0]
    assert "6 query heads are not a multiple of 4" in heads and "algorithm='allgather'" in heads
    assert "3 KV heads neither split over 4 ranks nor replicate" in kv
    assert "3 KV heads neither split over 2 ranks" in hybrid and "Ulysses group" in hybrid
    assert "needs group=doccp.HybridGroup" in no_group
    assert "do not factor its whole group [0, 1, 2, 3] as Ulysses groups of consecutive ranks" in swapped


def test_auto_chooses_ulysses_where_the_kv_exchange_is_heavy():
    mha = Shapes(8, 8, 64, 2)
    one_long = doccp.plan(DocLayout.from_lengths([8192]), 4, Mask.causal(), "balanced")
    many_short = doccp.plan(DocLayout.from_lengths([64] * 128), 4, Mask.causal(), "balanced")
    for device in ("cpu", "cuda"):
        assert choose_algorithm(one_long, mha, device) == "ulysses"
        assert choose_algorithm(many_short, mha, device) == "allgather"  # documents held whole: nothing moves
    # Ulysses' traffic does not depend on how the documents are cut; the all-gather's grows with the cuts.
    ulysses = [predicted_bytes(plan, "ulysses", mha) for plan in (one_long, many_short)]
    assert ulysses[0] == ulysses[1] and max(ulysses[0]) < max(predicted_bytes(one_long, "allgather", mha))
    # Query heads that do not split over the ranks rule Ulysses out.
    assert choose_algorithm(doccp.plan(DocLayout.from_lengths([8192]), 3), mha) != "ulysses"


@pytest.mark.parametrize("heads", [(4, 1), (8, 2), (8, 8)])
def test_ulysses_traffic_formula(heads):
    """Rank r receives the other ranks' tokens on its heads of q, k, v (a replicated KV head counts
    once per rank that needs it) and its own tokens' out and lse from every other rank."""
    hq, hkv = heads
    plan = doccp.plan(DocLayout.from_lengths([30, 1, 0, 17]), 4, Mask.causal(), "balanced")
    got = predicted_bytes(plan, "ulysses", Shapes(hq, hkv, D, 4))
    t, h, hk = plan.layout.num_tokens, hq // 4, max(hkv // 4, 1)
    want = [(t - tr) * (h + 2 * hk) * D * 4 + tr * 3 * h * (D * 4 + 4) for tr in plan.local_sizes]
    assert got == want
