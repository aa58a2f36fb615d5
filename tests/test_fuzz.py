"""Random cases against the float64 oracle: attention (hybrid groups too), inference, the padded interface, plan stats;
and schedules at many ranks against the minimal exchange.

Each test draws rounds of random layouts (zero-length and 1-token documents, documents around
2N, one long document among short ones), masks (random windows and chunk sizes), strategies
and algorithms, and checks them with the harness of the path's own test module, on real gloo
groups of random size. The draw is seeded, so a passing command passes again; a wider search is
one environment variable away::

    DOCCP_FUZZ_SEED=7 DOCCP_FUZZ_ROUNDS=200 pytest tests/test_fuzz.py

(200 rounds of each: about 20 minutes on 2 cores). A failure names the seed, the round and the
cases to reproduce it. Campaigns like that found a decode step failing on a cache of empty prompts
only, and the planner keeping a far less balanced plan than head_tail's where none balances.
"""

from __future__ import annotations

import os
import random

import test_algorithms as algorithm_cases
import test_attention as attention_cases
import test_inference as inference_cases
import test_padded as padded_cases
import test_plan as plan_cases
import torch
from oracle import visible

from doccp import DocLayout, Mask, plan
from doccp.launch import spawn
from doccp.plan import STRATEGIES
from doccp.plan.balanced import TOLERANCE
from doccp.plan.bound import kv_lower_bound

SEED = int(os.environ.get("DOCCP_FUZZ_SEED", "0"))
ROUNDS = int(os.environ.get("DOCCP_FUZZ_ROUNDS", "2"))


def _rounds(name: str):
    """``(round, rng)`` per round, each round its own seeded generator (a failing round replays alone)."""
    for i in range(ROUNDS):
        yield i, random.Random(f"{name}:{SEED}:{i}")


def _where(name: str, i: int, cases) -> str:
    return f"DOCCP_FUZZ_SEED={SEED}, {name} round {i}: {cases}"


def _run_and_check(harness, n: int, cases: list, where: str, **spawn_args) -> None:
    """A test module's ``run_cases`` on ``n`` spawned ranks, checked by its ``check``; a failure says ``where``."""
    results = spawn(harness.run_cases, n, n, cases, **spawn_args)
    try:
        harness.check(results, cases, n)
    except AssertionError as e:
        raise AssertionError(f"{where}\n{e}") from None


def _lengths(rng: random.Random, n: int, longest: int = 60) -> list[int]:
    style = rng.random()
    if style < 0.3:
        lengths = [rng.choice([0, 1, 2, 3, 2 * n - 1, 2 * n, 2 * n + 1]) for _ in range(rng.randint(1, 10))]
    elif style < 0.6:
        lengths = [rng.randint(0, longest) for _ in range(rng.randint(1, 10))]
    else:
        lengths = [rng.randint(0, 3 * longest)] + [rng.randint(0, 12) for _ in range(rng.randint(0, 9))]
    return lengths if sum(lengths) else [*lengths, 1]


def _mask(rng: random.Random, full: bool = True) -> Mask:
    kinds = [Mask.causal(), Mask.sliding_window(rng.randint(1, 9)), Mask.chunked(rng.randint(1, 9))]
    if full:
        kinds += [Mask.full(), Mask.sliding_window(rng.randint(0, 6), rng.randint(1, 5))]
    return rng.choice(kinds)


def test_fuzz_attention():
    """Forward, LSE, gradients and bytes received of all-gather, ring pass-KV and (where the heads
    divide over the ranks) Ulysses, on the default group of 2-5 ranks."""
    for i, rng in _rounds("attention"):
        n = rng.randint(2, 5)
        algorithms = attention_cases.ALGORITHMS + (["ulysses"] if attention_cases.HQ % n == 0 else [])
        cases = [(_lengths(rng, n), rng.choice(attention_cases.STRATEGIES), _mask(rng), rng.choice(algorithms),
                  rng.randint(0, 10**6)) for _ in range(6)]
        _run_and_check(attention_cases, n, cases, _where("attention", i, cases))


def test_fuzz_hybrid():
    """Ulysses inside groups of 2 ranks and all-gather across them (a :class:`doccp.HybridGroup`, from
    ranks or from a device mesh), and ``auto`` on one, over 4 ranks; GQA with 1, 2 or 4 KV heads."""
    for i, rng in _rounds("hybrid"):
        cases = []
        for _ in range(6):
            algorithm, group = rng.choice([("hybrid", "u2"), ("hybrid", "mesh u2"), ("auto", "u2")])
            cases.append(algorithm_cases.Case(_lengths(rng, 4), rng.choice(algorithm_cases.STRATEGIES), _mask(rng),
                                              algorithm, rng.choice([(4, 1), (4, 2), (8, 4)]), group,
                                              rng.randint(0, 10**6)))
        _run_and_check(algorithm_cases, 4, cases, _where("hybrid", i, cases), threads=1)


def test_fuzz_inference():
    """Prefill (pass-KV, pass-Q, auto) and decode turns over a sharded cache, in any order."""
    for i, rng in _rounds("inference"):
        n = rng.randint(2, 4)
        todo = []
        for _ in range(4):
            seqs, turns = rng.randint(1, 5), []
            for _ in range(rng.randint(1, 4)):
                if turns and rng.random() < 0.4:
                    turns.append(("decode", rng.randint(1, 4)))
                else:
                    turns.append(("prefill", tuple(rng.choice([0, 1, 2, rng.randint(0, 40)]) for _ in range(seqs))))
            todo.append(inference_cases.Case(tuple(turns), _mask(rng, full=False),
                                             rng.choice(["pass_kv", "pass_q", "auto"]),
                                             rng.choice(inference_cases.STRATEGIES), gather=rng.random() < 0.5,
                                             seed=rng.randint(0, 10**6)))
        _run_and_check(inference_cases, n, todo, _where("inference", i, todo), threads=1)


def test_fuzz_padded():
    """shard_padded / unshard_padded / padded_attention, forward and gradients, rows of any length."""
    for i, rng in _rounds("padded"):
        n = rng.randint(2, 4)
        cases = []
        for _ in range(4):
            lens = [rng.choice([0, 1, 2, n, 2 * n - 1, rng.randint(0, 50)]) for _ in range(rng.randint(1, 5))]
            hkv = rng.choice([1, 2])
            hq = hkv * rng.choice([1, 2])
            cases.append((lens, max(lens) + rng.choice([0, 1, 3]) or 1, hq, hkv, rng.choice([4, 8]), _mask(rng),
                          rng.choice(["auto", "allgather", "ring_kv"]), hq == 1 and rng.random() < 0.5))
        assert spawn(padded_cases.run_cases, n, n, cases, threads=1) == [len(cases) + 1] * n, _where("padded", i, cases)


def test_fuzz_plan_stats():
    """``Plan.stats()`` and ``kv_received`` against token sets counted one by one, every strategy and
    mask kind, 1-9 ranks."""
    for i, rng in _rounds("stats"):
        for _ in range(25):
            n = rng.randint(1, 9)
            lengths, mask = _lengths(rng, n, 90), _mask(rng)
            p = plan(DocLayout.from_lengths(lengths), n, mask, rng.choice(["balanced", "head_tail", "contiguous"]))
            held = [{(d, pos) for d, a, b in p.pieces(r) for pos in range(a, b)} for r in range(n)]
            work, needed = [0] * n, [set() for _ in range(n)]
            for r in range(n):
                for d, pos in held[r]:
                    keys = torch.arange(lengths[d])
                    seen = keys[visible(mask, torch.tensor(pos), keys)].tolist()
                    work[r] += len(seen)
                    needed[r].update((d, key) for key in seen)
            s, what = p.stats(), _where("stats", i, (lengths, n, mask, p.strategy))
            assert set().union(*held) == {(d, pos) for d, m in enumerate(lengths) for pos in range(m)}, what
            assert s.tokens == [len(h) for h in held] == list(p.local_sizes), what
            assert s.work == work, what
            received = [len(need - h) for need, h in zip(needed, held, strict=True)]
            assert s.kv_recv == received == list(p.kv_received), what
            assert s.pieces == [len(p.pieces(r)) for r in range(n)], what


def test_fuzz_schedules_at_many_ranks():
    """The all-gather and ring schedules of a few ranks against the minimal exchange and the general
    path (host only, as in ``test_plan``), 17-1100 ranks: where a rank holds a few tokens or none;
    ``stats()`` counts the exchange's KV, and a balanced plan receives no less than the lower bound."""
    for i, rng in _rounds("many ranks"):
        for _ in range(3):
            n = rng.randint(17, 1100)
            lengths = _lengths(rng, n, rng.choice([60, 400, 2 * n]))
            layout, strategy, mask = DocLayout.from_lengths(lengths), rng.choice(sorted(STRATEGIES)), _mask(rng)
            ranks = sorted({0, n - 1, *(rng.randrange(n) for _ in range(3))})
            what = _where("many ranks", i, (lengths, n, mask, strategy, ranks))
            try:
                p = plan(layout, n, mask, strategy)
                plan_cases.assert_allgather_sends_its_exchange_rows(p, ranks)
                s = p.stats()
                assert s.kv_recv == p.exchange.tokens_received(n).tolist()
                assert s.imbalance > TOLERANCE or max(s.kv_recv) >= kv_lower_bound(layout, n, mask)
                plan_cases.assert_causal_ring_matches_the_general_path(layout, n, strategy, ranks)
            except AssertionError as e:
                raise AssertionError(f"{what}\n{e}") from None
