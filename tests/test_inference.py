"""CP inference (prefill over a sharded KV cache, decode) vs the float64 oracle, on real gloo groups.

Each case feeds sequences turn by turn (prefill of new tokens, decode steps); every output
row must equal the dense oracle over the final sequences at that token's position (the
masks look only backwards, so later tokens do not change earlier rows).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from oracle import dense_attention, expect_errors

import doccp
from doccp import DocLayout, Mask
from doccp.inference import choose_prefill_algorithm
from doccp.launch import spawn

HQ, HKV, D = 4, 2, 16  # GQA 2:1
MASKS = [Mask.causal(), Mask.sliding_window(7), Mask.chunked(5)]
ALGORITHMS = ["pass_kv", "pass_q"]
STRATEGIES = ["balanced", "head_tail", "contiguous"]
MISS_RATES = [0.01, 0.1, 1.0]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "generate.py"


@dataclass(frozen=True)
class Case:
    turns: tuple  # ("prefill", new tokens per sequence) or ("decode", steps)
    mask: Mask
    algorithm: str
    strategy: str = "balanced"
    gather: bool = False
    seed: int = 0

    def lengths(self) -> list[int]:
        """Final length of every sequence."""
        total = [0] * len(self.turns[0][1])
        for kind, arg in self.turns:
            added = arg if kind == "prefill" else [arg] * len(total)
            total = [t + n for t, n in zip(total, added, strict=True)]
        return total

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of every token of the final sequences (float64 values of fp32 numbers)."""
        g = torch.Generator().manual_seed(self.seed)
        t = sum(self.lengths())
        return tuple(torch.randn(t, h, D, generator=g).double() for h in (HQ, HKV, HKV))


def prompts(world_size: int) -> list[int]:
    return [150, 37, 0, 61, 2 * world_size + 1]  # an empty sequence and one shorter than 2N


def cases(world_size: int) -> list[Case]:
    p = prompts(world_size)
    out = []
    for i, (mask, algorithm, miss) in enumerate(itertools.product(MASKS, ALGORITHMS, MISS_RATES)):
        new = [math.ceil(miss * n) for n in p]
        cached = [n - m for n, m in zip(p, new, strict=True)]
        turns = ([("prefill", tuple(cached))] if miss < 1 else []) + [("prefill", tuple(new)), ("decode", 8)]
        out.append(Case(tuple(turns), mask, algorithm, STRATEGIES[i % 3], gather=i % 2 == 0, seed=i))
    for j, algorithm in enumerate(ALGORITHMS):  # a second turn after decode meets strided (decoded) runs
        turns = (("prefill", tuple(p)), ("decode", 5), ("prefill", (9, 0, 4, 30, 1)), ("decode", 3))
        out.append(Case(turns, MASKS[j % 2], algorithm, STRATEGIES[j], gather=j == 0, seed=100 + j))
        out.append(Case(turns, MASKS[1 - j % 2], algorithm, "head_tail", seed=200 + j))
    few = (1, 0, 0, 0, 1)  # fewer new tokens than ranks: some ranks have no queries
    out.append(Case((("prefill", tuple(p)), ("decode", 2), ("prefill", few), ("decode", 1)), MASKS[1], "pass_q",
                    seed=300))
    out.append(Case((("prefill", few), ("decode", 2), ("prefill", tuple(p))), MASKS[0], "pass_kv", seed=301))
    out.append(Case((("prefill", tuple(p)), ("decode", 2)), Mask.causal(), "auto", seed=302))
    empty = (0,) * len(p)  # every prompt empty: the first decoded tokens are the cache's first runs
    out.append(Case((("prefill", empty), ("decode", 3), ("prefill", tuple(p)), ("decode", 1)), MASKS[1], "pass_q",
                    strategy="head_tail", seed=303))
    return out


def run_cases(rank: int, world_size: int, todo: list[Case]) -> list[dict]:
    """Worker: every case on this rank; returns (stream rows, out, lse) of every call."""
    results = []
    for case in todo:
        q, k, v = (x.float() for x in case.inputs())
        starts = DocLayout.from_lengths(case.lengths()).cu_seqlens[:-1]
        cache = doccp.ShardedKVCache.for_group()
        calls = []
        for kind, arg in case.turns:
            if kind == "prefill":
                plan = doccp.plan(DocLayout.from_lengths(list(arg)), world_size, case.mask, case.strategy)
                cached = cache.lengths if cache.num_seqs is not None else torch.zeros(len(arg), dtype=torch.int64)
                rows = (starts + cached)[plan.doc_ids(rank)] + plan.positions(rank)
                out, lse = doccp.prefill(q[rows], k[rows], v[rows], plan, cache, algorithm=case.algorithm,
                                         return_lse=True)
                calls.append((rows, out, lse))
                continue
            for _ in range(arg):
                rows = starts + cache.lengths
                out, lse = doccp.decode(q[rows], k[rows], v[rows], cache, gather=case.gather, return_lse=True)
                calls.append((rows if case.gather else rows[rank::world_size], out, lse))
        covered = [torch.cat([cache.positions(r, b) for r in range(world_size)]).sort().values.tolist()
                   for b in range(cache.num_seqs)]
        results.append({"calls": calls, "covered": covered})
    return results


def check(results_per_rank: list[list[dict]], todo: list[Case], world_size: int) -> None:
    for i, case in enumerate(todo):
        q, k, v = case.inputs()
        lengths = case.lengths()
        ref_out, ref_lse = dense_attention(q, k, v, DocLayout.from_lengths(lengths), case.mask)
        what = f"case {i} N={world_size}: {case}"
        for r in range(world_size):
            got = results_per_rank[r][i]
            assert got["covered"] == [list(range(n)) for n in lengths], f"{what}: cached positions on rank {r}"
            for rows, out, lse in got["calls"]:
                assert not torch.isnan(out).any(), what
                torch.testing.assert_close(out.double(), ref_out[rows], atol=2e-5, rtol=0, msg=what)
                finite = torch.isfinite(ref_lse[:, rows])
                assert torch.equal(torch.isfinite(lse), finite), what
                torch.testing.assert_close(lse.double()[finite], ref_lse[:, rows][finite], atol=2e-5, rtol=0)


def run_balance(rank: int, world_size: int, rounds: int) -> dict:
    """Prefill, then N * rounds decode steps: every rank must gain ``rounds`` tokens of every sequence."""
    p = prompts(world_size)
    plan = doccp.plan(DocLayout.from_lengths(p), world_size)
    q, kv = torch.randn(sum(p), HQ, D)[plan.indices(rank)], torch.randn(sum(p), HKV, D)[plan.indices(rank)]
    cache = doccp.ShardedKVCache.for_group()
    doccp.prefill(q, kv, kv, plan, cache)
    before = cache.rank_lengths()
    per_step = []
    for _ in range(world_size * rounds):
        counts = cache.rank_lengths()
        kv = torch.randn(len(p), HKV, D)
        doccp.decode(torch.randn(len(p), HQ, D), kv, kv, cache)
        per_step.append((cache.rank_lengths() - counts).sum(1))
    return {"gained": cache.rank_lengths() - before, "per_step": torch.stack(per_step),
            "runs_per_seq": len(cache.runs) / len(p), "reallocations": cache.reallocations}


def run_bad_input(rank: int, world_size: int) -> list[str]:
    """Each bad call must raise on every rank (no hang); the group must work afterwards."""
    plan = doccp.plan(DocLayout.from_lengths([10, 7, 0]), world_size)
    x = torch.randn(17, HQ, D)
    q, kv = x[plan.indices(rank)], x[plan.indices(rank), :HKV]
    step = torch.randn(3, HQ, D)
    fresh = doccp.ShardedKVCache.for_group()
    cache = doccp.ShardedKVCache.for_group()
    doccp.prefill(q, kv, kv, plan, cache)
    calls = {
        "decode before prefill": lambda: doccp.decode(step, step[:, :HKV], step[:, :HKV], fresh),
        "prefill count": lambda: doccp.prefill(q, kv, kv, doccp.plan(DocLayout.from_lengths([10, 7]), world_size),
                                               cache),
        "decode count": lambda: doccp.decode(step[:2], step[:2, :HKV], step[:2, :HKV], cache),
        "cache/group size": lambda: doccp.decode(step, step[:, :HKV], step[:, :HKV],
                                                 doccp.ShardedKVCache(world_size + 1, rank)),
        "rank 1 only": lambda: doccp.decode(step if rank != 1 else step[:, :3], step[:, :HKV], step[:, :HKV], cache),
        "algorithm": lambda: doccp.prefill(q, kv, kv, plan, cache, algorithm="zigzag"),
    }
    messages = expect_errors(calls, rank)
    doccp.decode(step, step[:, :HKV], step[:, :HKV], cache)  # still in step with each other
    for _ in range(10):  # fresh caches with one plan: each call validates collectively (ids get reused)
        doccp.prefill(q, kv, kv, plan, doccp.ShardedKVCache.for_group())
    return messages


def run_all(rank: int, world_size: int, todo: list[Case]) -> dict:
    return {"cases": run_cases(rank, world_size, todo), "balance": run_balance(rank, world_size, 3),
            "bad": run_bad_input(rank, world_size) if world_size > 1 else None}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_inference_matches_reference(world_size):
    todo = cases(world_size)
    results = spawn(run_all, world_size, world_size, todo, threads=1)
    check([r["cases"] for r in results], todo, world_size)
    for r in results:
        balance = r["balance"]
        assert (balance["gained"] == 3).all(), balance["gained"]  # every rank, every sequence
        assert balance["per_step"].max() - balance["per_step"].min() <= 1  # each step spreads the batch
        assert balance["runs_per_seq"] <= world_size * 3  # a few runs per (rank, sequence), not one per token
        assert balance["reallocations"] <= 3
    if world_size > 1:
        for messages in (r["bad"] for r in results):
            assert len(messages) == 6
            assert "decode before prefill" in messages[0]
            assert "sequence count mismatch" in messages[1] and "2 documents" in messages[1]
            assert "sequence count mismatch" in messages[2]
            assert f"world_size={world_size + 1}" in messages[3] and f"{world_size} ranks" in messages[3]
            assert "rank 1" in messages[4]
            assert "algorithm must be" in messages[5]


def test_cache_grows_geometrically():
    """One process, no group: a long decode moves few regions and keeps one run per sequence."""
    lengths = [5, 40, 0]
    plan = doccp.plan(DocLayout.from_lengths(lengths), 1)
    cache = doccp.ShardedKVCache(1, 0)
    doccp.prefill(torch.randn(45, HQ, D), torch.randn(45, HKV, D), torch.randn(45, HKV, D), plan, cache)
    capacities = set()
    for _ in range(300):
        doccp.decode(torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D), cache)
        capacities.add(cache.capacity)
    assert cache.lengths.tolist() == [305, 340, 300]
    live = 945
    assert cache.reallocations <= 12 and len(capacities) <= 12
    assert cache.rows_copied <= 6 * live  # growth copies O(1) rows per token, not the cache per step
    assert cache.capacity <= 2.5 * live
    assert len(cache.runs) == 3  # N = 1: decoded tokens extend the prompt's run
    k, _ = cache.local_kv(1)
    assert k.shape == (340, HKV, D)


@pytest.mark.parametrize("solo_keys", [1, 1 << 30])
def test_decode_one_process(monkeypatch, solo_keys):
    """N = 1, no group: decode with the cpu backend running key ranges alone (1) or batched (2**30)."""
    monkeypatch.setattr(sys.modules["doccp.kernels.cpu"], "SOLO_KEYS", solo_keys)
    case = Case((("prefill", (30, 0, 12)), ("decode", 4)), Mask.sliding_window(9), "pass_kv", seed=7)
    check([run_cases(0, 1, [case])], [case], 1)


def algorithm_5(t, p, n, h, hkv, d, e, flops, bw) -> str:
    """The paper's closed form; ``w`` weighs the all-to-all by the fp32 out + lse doccp sends."""
    if t >= n * flops * hkv * e / (2 * h * bw):
        return "pass_kv"
    w = 4 * (d + 1) / (d * e)
    return "pass_kv" if w * t / (t + p) >= 2 * hkv / h - 4 * t * bw / (n * flops * e) else "pass_q"


def test_heuristic_is_algorithm_5_under_perfect_overlap():
    n, h, hkv, d, flops, bw = 8, 128, 8, 128, 100e12, 50e9  # hiding threshold: 1000 new tokens
    decide = {"dtype": torch.bfloat16, "head_dim": d, "flops": flops, "bandwidth": bw}
    # where pass-Q's own hop hides (T + P >= N*C*e / (4*BW) = 8000), the model is the closed form
    for t, p in itertools.product([10, 100, 500, 999, 1001, 5000, 50000], [10**4, 10**5, 10**6]):
        got = choose_prefill_algorithm(t, p, n, h, hkv, overlap=1.0, **decide)
        assert got == algorithm_5(t, p, n, h, hkv, d, 2, flops, bw), (t, p)
    assert choose_prefill_algorithm(1001, 10**6, n, h, hkv, overlap=1.0, **decide) == "pass_kv"
    assert choose_prefill_algorithm(100, 10**6, n, h, hkv, overlap=1.0, **decide) == "pass_q"
    assert choose_prefill_algorithm(100, 0, n, h, hkv, overlap=1.0, **decide) == "pass_kv"  # full prefill
    assert choose_prefill_algorithm(5, 10**6, 1, h, hkv) == "pass_kv"  # one rank: nothing travels


def test_heuristic_charges_hops_that_do_not_hide():
    """With no overlap (CPU gloo) pass-KV pays its whole transfer: pass-Q wins until it moves
    as many bytes (Q + partial outputs vs K + V: a miss rate near Hkv/H)."""
    decide = {"dtype": torch.float32, "head_dim": 64, "flops": 40e9, "bandwidth": 0.7e9}
    assert choose_prefill_algorithm(3277, 29491, 2, 8, 2, overlap=0.0, **decide) == "pass_q"  # 10%
    assert choose_prefill_algorithm(16384, 16384, 2, 8, 2, overlap=0.0, **decide) == "pass_kv"  # 50%
    assert choose_prefill_algorithm(3277, 29491, 2, 8, 2, overlap=1.0, **decide) == "pass_kv"


def _load_example():
    sys.path.insert(0, str(EXAMPLE.parent))  # spawned ranks import it by name
    spec = importlib.util.spec_from_file_location("generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["generate"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("world_size", [2, 3])
def test_generate_example_matches_one_process(world_size):
    example = _load_example()
    result = example.generate(world_size, new_tokens=16)
    assert result.cp_tokens == result.reference_tokens
    assert all(len(t) == 16 for t in result.cp_tokens)
