"""Adversarial inputs: every class of attack from docs/reliability.md gives the exact answer or the
same clear error on every rank; never a silent wrong result, never a hang.

Distributed cases run on real gloo groups with a short process-group timeout and a hard
deadline, so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from oracle import dense_attention

import doccp
from doccp import DocLayout, Mask
from doccp.inference import ShardedKVCache, decode, prefill
from doccp.kernels import nonfinite
from doccp.launch import WorkerError, spawn

QUICK = {"timeout_s": 60, "deadline_s": 300}  # a group's collectives give up after 60 s; a run after 300 s
HQ, HKV, D = 4, 2, 8


def stream(layout: DocLayout, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = layout.num_tokens
    return tuple(torch.randn(t, h, D, generator=g, dtype=torch.float64).to(dtype) for h in (HQ, HKV, HKV, HQ))


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values with a non-unit stride on every dimension, the head dim included."""
    wide = torch.zeros(*x.shape[:-1], 3 * x.shape[-1], dtype=x.dtype).index_copy(
        -1, torch.arange(0, 3 * x.shape[-1], 3), x)
    return wide[..., ::3]


def run_all(errors: dict, rank: int) -> dict[str, str]:
    """Each call must raise ValueError/TypeError on this rank; returns name -> message."""
    seen = {}
    for name, call in errors.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            seen[name] = str(e)
        else:
            raise AssertionError(f"{name}: no error on rank {rank}")
    return seen


# -- 1. strides --------------------------------------------------------------------------------
def test_varlen_any_stride_is_exact():
    layout = DocLayout.from_lengths([7, 0, 13, 1])
    q, k, v, dout = stream(layout)
    for backend in ("cpu", "reference"):
        want = doccp.varlen_attention(q, k, v, layout, backend=backend)
        got = doccp.varlen_attention(strided(q), strided(k), strided(v), layout, backend=backend)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        leaves = [strided(x).requires_grad_() for x in (q, k, v)]
        doccp.varlen_attention(*leaves, layout, backend=backend).backward(strided(dout))
        dense = [x.clone().requires_grad_() for x in (q, k, v)]
        doccp.varlen_attention(*dense, layout, backend=backend).backward(dout)
        for a, b in zip(leaves, dense, strict=True):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0)


def test_doc_packed_any_stride_is_exact():
    cu = torch.tensor([[0, 5, 12], [0, 12, 12]])
    q, k, v = (torch.randn(2, 12, h, D) for h in (HQ, HKV, HKV))
    want = doccp.doc_packed_attn(q, k, v, cu)
    got = doccp.doc_packed_attn(strided(q), strided(k), strided(v), cu)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def strided_cp(rank: int, world_size: int) -> list[tuple]:
    layout = DocLayout.from_lengths([9, 1, 0, 23, 4])
    results = []
    for strategy, algorithm in (("balanced", "allgather"), ("head_tail", "ring_kv"), ("contiguous", "ulysses")):
        plan = doccp.plan(layout, world_size, Mask.causal(), strategy)
        q, k, v, dout = (doccp.shard(x, plan, rank) for x in stream(layout))
        outs = []
        for make in (lambda x: x.clone(), strided):
            leaves = [make(x).requires_grad_() for x in (q, k, v)]
            out = doccp.attention(*leaves, plan, algorithm=algorithm)
            out.backward(make(dout))
            outs.append((out.detach(), *(x.grad for x in leaves)))
        results.append((strategy, algorithm, outs))
        cache = ShardedKVCache.for_group()
        prefilled = prefill(strided(q), strided(k), strided(v), plan, cache, algorithm="pass_q")
        results.append(("prefill", "pass_q", [(prefill(q, k, v, plan, ShardedKVCache.for_group(),
                                                        algorithm="pass_q"),), (prefilled,)]))
    return results


def test_cp_any_stride_is_exact():
    for per_rank in spawn(strided_cp, 2, 2, **QUICK):
        for strategy, algorithm, (dense, wide) in per_rank:
            for a, b in zip(dense, wide, strict=True):
                torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=f"{strategy} {algorithm}")


# -- 2. ranks that disagree --------------------------------------------------------------------
def disagreeing(rank: int, world_size: int) -> dict[str, str]:
    lengths = [30, 12, 0, 21]
    layout = DocLayout.from_lengths(lengths)
    plan = doccp.plan(layout, world_size)
    other = {
        "strategy": doccp.plan(layout, world_size, strategy="head_tail"),
        "mask": doccp.plan(layout, world_size, Mask.sliding_window(4)),
        "layout, same tokens": doccp.plan(DocLayout.from_lengths([20, 22, 0, 21]), world_size),
        "layout, more tokens": doccp.plan(DocLayout.from_lengths([40, 12, 0, 21]), world_size),
    }
    errors = {}
    for what, alt in other.items():
        mine = alt if rank == 1 else plan
        q, k, v, _ = (doccp.shard(x, mine, rank) for x in stream(mine.layout))
        errors[f"attention, {what}"] = lambda q=q, k=k, v=v, mine=mine: doccp.attention(q, k, v, mine)
        errors[f"unshard, {what}"] = lambda q=q, mine=mine: doccp.unshard(q, mine)
        if mine.mask.right == 0:
            errors[f"prefill, {what}"] = lambda q=q, k=k, v=v, mine=mine: prefill(
                q, k, v, mine, ShardedKVCache.for_group())
    q, k, v, _ = (doccp.shard(x, plan, rank) for x in stream(layout))
    errors["algorithm"] = lambda: doccp.attention(q, k, v, plan, algorithm="ring_kv" if rank == 1 else "allgather")
    seen = run_all(errors, rank)
    doccp.attention(q, k, v, plan)  # the group is still usable afterwards
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_plans_raise_on_every_rank(world_size):
    for messages in spawn(disagreeing, world_size, world_size, **QUICK):
        for name, message in messages.items():
            what = "algorithm" if name == "algorithm" else "plan"
            assert f"disagree on {what}" in message, f"{name}: {message}"
            assert "rank 1:" in message and ("rank 0:" in message or "ranks 0, 2:" in message), f"{name}: {message}"


# -- 3, 4. huge numbers --------------------------------------------------------------------------
def test_huge_windows_are_unbounded_and_unrepresentable_ones_rejected():
    assert Mask.sliding_window(sys.maxsize) == Mask.causal()
    assert Mask.sliding_window(2**40, 2**35) == Mask.full()
    layout = DocLayout.from_lengths([9, 30])
    q, k, v, _ = stream(layout)
    for backend in ("cpu", "reference"):
        torch.testing.assert_close(doccp.varlen_attention(q, k, v, layout, Mask(sys.maxsize, 0), backend=backend),
                                   doccp.varlen_attention(q, k, v, layout, backend=backend), atol=0, rtol=0)
    with pytest.raises(ValueError, match="cannot be represented"):
        Mask.sliding_window(2**63)
    with pytest.raises(ValueError, match="cannot be represented"):
        Mask.parse("window:99999999999999999999")


@pytest.mark.parametrize("make", [
    lambda: DocLayout.from_lengths([2**62] * 3),
    lambda: DocLayout.from_lengths([2**30, 2**30, 2**30]),
    lambda: DocLayout.from_cu_seqlens([0, 2**40]),
    lambda: DocLayout.from_lengths([2**64]),
    lambda: DocLayout.from_padded([3], 2**40),
], ids=["2**62 x 3", "sum over limit", "cu_seqlens", "beyond int64", "padded row"])
def test_layouts_beyond_the_token_limit_are_rejected(make):
    with pytest.raises(ValueError, match=r"2\*\*31 - 1|int64|2147483647"):
        make()


# -- 5. bad input on one rank after a good step ----------------------------------------------------
def bad_after_good(rank: int, world_size: int) -> list[str]:
    layout = DocLayout.from_lengths([17, 5, 30])
    plan = doccp.plan(layout, world_size)
    q, k, v, _ = (doccp.shard(x, plan, rank) for x in stream(layout))
    messages = []
    for step in range(3):
        doccp.attention(q, k, v, plan)  # good steps: the call is remembered nowhere that matters
        broken = [q[1:], q[:, :3], q.double()][step]  # wrong tokens, heads, dtype
        try:
            doccp.attention(broken if rank == 1 else q, k, v, plan)
        except (ValueError, TypeError) as e:
            messages.append(str(e))
    return messages


def test_bad_input_on_one_rank_after_good_steps_raises_everywhere():
    start = time.monotonic()
    results = spawn(bad_after_good, 2, 2, **QUICK)
    assert time.monotonic() - start < 60
    for rank, messages in enumerate(results):
        assert len(messages) == 3, messages
        if rank == 0:
            assert all("reported by rank 1" in m for m in messages), messages


# -- 6. empty ranks and empty streams -----------------------------------------------------------
def empty_ranks(rank: int, world_size: int, lengths: list[int]) -> list[tuple]:
    layout = DocLayout.from_lengths(lengths)
    out = []
    for strategy in ("contiguous", "head_tail", "balanced"):
        plan = doccp.plan(layout, world_size, Mask.causal(), strategy)
        for algorithm in ("allgather", "ring_kv"):
            q, k, v, dout = (doccp.shard(x, plan, rank).requires_grad_() for x in stream(layout))
            o, lse = doccp.attention(q, k, v, plan, algorithm=algorithm, return_lse=True)
            o.backward(dout.detach())
            full = doccp.unshard(o.detach(), plan)
            out.append((strategy, algorithm, full, q.grad, k.grad, v.grad, plan.indices(rank)))
    return out


@pytest.mark.parametrize(("world_size", "lengths"), [(3, [1, 0, 1]), (4, [2, 1]), (2, []), (2, [0, 0]), (1, [])])
def test_ranks_without_tokens_are_exact(world_size, lengths):
    layout = DocLayout.from_lengths(lengths)
    q, k, v, dout = (x.double().requires_grad_() for x in stream(layout))
    ref, _ = dense_attention(q, k, v, layout, Mask.causal())
    ref.backward(dout)
    for per_rank in spawn(empty_ranks, world_size, world_size, lengths, **QUICK):
        for strategy, algorithm, full, dq, dk, dv, idx in per_rank:
            what = f"{strategy} {algorithm}"
            torch.testing.assert_close(full.double(), ref.detach(), atol=2e-5, rtol=0, msg=what)
            for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
                torch.testing.assert_close(got.double(), want[idx], atol=1e-4, rtol=0, msg=what)


# -- 7, 8. the launcher ------------------------------------------------------------------------------
def fail_then_victims(rank: int) -> int:
    if rank == 1:
        time.sleep(0.2)
        raise ValueError("the root cause")
    dist.barrier()  # rank 0 waits for rank 1: its error is a consequence
    return rank


def exit_7(rank: int) -> int:
    if rank == 1:
        os._exit(7)
    dist.barrier()
    return rank


def stuck_outside_collectives(rank: int) -> int:
    while rank == 1:
        time.sleep(0.05)
    return rank


def test_spawn_reports_the_root_cause_first():
    with pytest.raises(WorkerError) as raised:
        spawn(fail_then_victims, 2, **QUICK)
    assert (raised.value.rank, raised.value.kind, raised.value.message) == (1, "ValueError", "the root cause")
    assert str(raised.value).startswith("rank 1 raised ValueError: the root cause")
    with pytest.raises(WorkerError) as raised:
        spawn(exit_7, 2, **QUICK)
    assert (raised.value.rank, raised.value.kind, raised.value.message) == (1, "ProcessDied", "exit code 7")
    assert [f.rank for f in raised.value.failures] == [1, 0]


def test_spawn_stops_a_stuck_rank_and_says_where_it_was():
    start = time.monotonic()
    with pytest.raises(WorkerError) as raised:
        spawn(stuck_outside_collectives, 2, timeout_s=3)
    assert time.monotonic() - start < 30
    assert (raised.value.rank, raised.value.kind) == (1, "Stuck")
    assert "stuck_outside_collectives" in str(raised.value)  # its stack when stopped


# -- 9. the CLI -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["plan", "--lengths", "9223372036854775807"],
    ["plan", "--lengths", "1099511627776"],
    ["plan", "--lengths", "99999999999999999999999"],
    ["plan", "--lengths", "5", "--mask", "window:99999999999999999999"],
    ["plan", "--lengths", "5", "--world-size", "100000000"],
    ["plan", "--lengths", "5", "--world-size", "99999999999999999999999"],
    ["demo", "--tokens", "99999999999999999999"],
])
def test_cli_rejects_huge_numbers_with_one_line(args):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "doccp.app.cli.main", *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert time.monotonic() - start < 30


# -- 10. one rule for every entry point --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_finite_check_finds_every_nan_and_infinity(dtype):
    """kernels.nonfinite.all_finite (one min/max reduction) agrees with isfinite().all() wherever the
    bad value sits, in contiguous tensors and strided views, and empty tensors are finite."""
    from doccp.kernels.nonfinite import all_finite

    g = torch.Generator().manual_seed(0)
    assert all_finite(torch.empty(0, 2, 4, dtype=dtype), torch.randn(5, 2, 4, generator=g).to(dtype))
    for rows in (1, 33, 70001):
        base = torch.randn(rows, 3, 8, generator=g).to(dtype)
        assert all_finite(base, base[:, 1], base.transpose(0, 1))
        for bad in (float("nan"), float("inf"), float("-inf")):
            for row in {0, rows // 2, rows - 1}:
                x = base.clone()
                x[row, 1, 5] = bad
                assert not all_finite(x) and not all_finite(x[:, 1]) and not all_finite(base, x.transpose(0, 1))
                assert all_finite(x[:, 0])  # the bad value lies outside this view


def test_nonfinite_inputs_poison_exactly_the_rows_that_see_them():
    layout = DocLayout.from_lengths([6, 5, 7])
    q, k, v, _ = stream(layout, dtype=torch.float64)
    q[2, 1, 0] = float("nan")  # doc 0: query 2, head 1
    k[8, 0, 3] = float("inf")  # doc 1: key 2 (position 2), KV head 0 -> query heads 0, 1
    v[12, 1, 0] = float("-inf")  # doc 2: key position 1, KV head 1 -> query heads 2, 3
    outs = {b: doccp.varlen_attention(q, k, v, layout, return_lse=True, backend=b) for b in ("cpu", "reference")}
    expected = torch.zeros(18, HQ, dtype=torch.bool)
    expected[2, 1] = True
    expected[8:11, 0:2] = True  # causal: positions 2.. of doc 1 see key 2
    expected[12:18, 2:4] = True
    for backend, (out, lse) in outs.items():
        assert torch.equal(torch.isnan(out).any(-1), expected), backend
        assert torch.equal(torch.isnan(lse).T, expected), backend
        clean = ~expected  # their inputs are all finite: the same as with every non-finite value zeroed
        ref, ref_lse = dense_attention(*(torch.nan_to_num(x, 0.0, 0.0, 0.0) for x in (q, k, v)), layout, Mask.causal())
        torch.testing.assert_close(out.double()[clean], ref[clean], atol=1e-6, rtol=0)
        torch.testing.assert_close(lse.double().T[clean], ref_lse.T[clean], atol=1e-6, rtol=0)


def decode_nonfinite(rank: int, world_size: int) -> dict:
    """Prefill 3 prompts and decode 3 steps, clean and poisoned: in the poisoned run sequence 2's
    prompt has a NaN key (position 4, KV head 1) and sequence 1's token of step 1 an inf value (KV
    head 0). Per run: every step's gathered (out, lse) and every step's ``cache.finite``."""
    layout = DocLayout.from_lengths([9, 6, 11])
    plan = doccp.plan(layout, world_size)
    runs = {}
    for poisoned in (False, True):
        q, k, v, _ = stream(layout)
        g = torch.Generator().manual_seed(5)
        steps = [[torch.randn(3, h, D, generator=g) for h in (HQ, HKV, HKV)] for _ in range(3)]
        if poisoned:
            k[15 + 4, 1, 0] = float("nan")
            steps[1][2][1, 0, 2] = float("inf")
        cache = ShardedKVCache.for_group()
        prefill(*(doccp.shard(x, plan, rank) for x in (q, k, v)), plan, cache)
        runs[poisoned] = [(*decode(*step, cache, gather=True, return_lse=True), cache.finite) for step in steps]
    runs["holds the NaN"] = bool((plan.indices(rank) == 15 + 4).any())
    return runs


def test_decode_poisons_exactly_the_sequences_whose_cache_holds_a_nonfinite_value():
    """The cache checks rows as they arrive, so decode checks no cached row, and a NaN/inf in
    the cache still poisons exactly the (sequence, query head) rows that see it."""
    for rank, runs in enumerate(spawn(decode_nonfinite, 2, 2, **QUICK)):
        assert [finite for *_, finite in runs[False]] == [True] * 3
        # the inf of step 1 is cached on rank (sequence 1 + step 1) % 2 = 0
        expected_flags = [False] * 3 if runs["holds the NaN"] else [True, False, False] if rank == 0 else [True] * 3
        assert [finite for *_, finite in runs[True]] == expected_flags, rank
        for step, ((out, lse, _), (clean_out, clean_lse, _)) in enumerate(zip(runs[True], runs[False], strict=True)):
            expected = torch.zeros(3, HQ, dtype=torch.bool)
            expected[2, 2:] = True  # sequence 2's query heads over KV head 1, every step
            if step >= 1:
                expected[1, :2] = True  # sequence 1's over KV head 0, from the step of the inf
            assert torch.equal(torch.isnan(out).any(-1), expected), (rank, step)
            assert torch.equal(torch.isnan(lse).T, expected), (rank, step)
            torch.testing.assert_close(out[~expected], clean_out[~expected], atol=1e-6, rtol=0)
            torch.testing.assert_close(lse.T[~expected], clean_lse.T[~expected], atol=1e-6, rtol=0)


def test_a_decode_step_checks_its_queries_not_the_cache(monkeypatch):
    """Decode attends to the whole cache buffer every step; while the cache knows its rows are
    finite, the kernels' NaN/inf check reads only the step's queries."""
    checked = []
    check = nonfinite.all_finite

    def recording(*tensors):
        checked.extend(t.numel() for t in tensors)
        return check(*tensors)

    monkeypatch.setattr(nonfinite, "all_finite", recording)
    layout = DocLayout.from_lengths([300, 200])
    q, k, v, _ = stream(layout)
    cache = ShardedKVCache(1, 0)
    prefill(q, k, v, doccp.plan(layout, 1), cache)
    step = [torch.randn(2, h, D) for h in (HQ, HKV, HKV)]
    checked.clear()
    decode(*step, cache)
    assert cache.finite and checked == [2 * HQ * D]
    step[1][0, 0, 0] = float("inf")
    decode(*step, cache)
    assert not cache.finite
    checked.clear()
    out = decode(*step, cache)
    assert checked[:3] == [2 * HQ * D, cache.k.numel(), cache.v.numel()]  # a cache that saw an inf: every row
    assert torch.isnan(out[0, :HQ // HKV]).all() and not torch.isnan(out[0, HQ // HKV:]).any()
    assert not torch.isnan(out[1]).any()


def one_rule(rank: int, world_size: int) -> dict[str, dict[str, str]]:
    layout = DocLayout.from_lengths([6, 9])
    plan = doccp.plan(layout, world_size)
    q, k, v, _ = (doccp.shard(x, plan, rank) for x in stream(layout))
    cache = ShardedKVCache.for_group()
    prefill(q, k, v, plan, cache)
    b = layout.num_docs
    dq, dk, dv = torch.randn(b, HQ, D), torch.randn(b, HKV, D), torch.randn(b, HKV, D)
    lens = [6, 9]
    pq, pk, pv = (doccp.shard_padded(torch.randn(2, 9, h, D), lens, rank, world_size).x for h in (HQ, HKV, HKV))
    zero = (q[..., :0], k[..., :0], v[..., :0])
    entry = {
        "attention": lambda *a, **kw: doccp.attention(*(a or (q, k, v)), plan, **kw),
        "decode": lambda *a, **kw: decode(*(a or (dq, dk, dv)), cache, **kw),
        "padded": lambda *a, **kw: doccp.padded_attention(*(a or (pq, pk, pv)), lens, **kw),
        "varlen": lambda *a, **kw: doccp.varlen_attention(*(a or stream(layout)[:3]), layout, **kw),
        "doc_packed": lambda *a, **kw: doccp.doc_packed_attn(*(a or (x.unsqueeze(0) for x in stream(layout)[:3])),
                                                            torch.tensor([[0, 6, 15]]), **kw),
    }
    seen = {}
    for name, call in entry.items():
        bad = {"scale str": lambda call=call: call(scale="0.5"),
               "scale nan": lambda call=call: call(scale=float("nan")),
               "scale inf": lambda call=call: call(scale=float("inf"))}
        if name in ("attention", "varlen"):
            bad["head_dim 0"] = lambda call=call: call(*zero)
        seen[name] = run_all(bad, rank)
    return seen


def test_every_entry_point_checks_scale_and_head_dim_alike():
    for per_rank in spawn(one_rule, 2, 2, **QUICK):
        for name, messages in per_rank.items():
            assert "scale must be a real number" in messages["scale str"], name
            assert "scale must be finite" in messages["scale nan"], name
            assert "scale must be finite" in messages["scale inf"], name
            if "head_dim 0" in messages:
                assert "same head_dim, at least 1" in messages["head_dim 0"], name


# -- 11. no process group --------------------------------------------------------------------------------
def test_attention_without_a_process_group_says_how_to_start_one():
    layout = DocLayout.from_lengths([4, 4])
    plan = doccp.plan(layout, 2)
    q, k, v, _ = (doccp.shard(x, plan, 0) for x in stream(layout))
    with pytest.raises(ValueError, match="no process group is initialised.*torchrun.*doccp.launch.spawn"):
        doccp.attention(q, k, v, plan)


# -- 12. inference masks ----------------------------------------------------------------------------------
def lookahead(rank: int, world_size: int) -> dict[str, str]:
    layout = DocLayout.from_lengths([5, 8])
    plan = doccp.plan(layout, world_size, Mask.sliding_window(4, 2))
    q, k, v, _ = (doccp.shard(x, plan, rank) for x in stream(layout))
    return run_all({"prefill": lambda: prefill(q, k, v, plan, ShardedKVCache.for_group())}, rank)


def test_inference_rejects_masks_that_look_ahead():
    for messages in spawn(lookahead, 2, 2, **QUICK):
        assert "never looks ahead" in messages["prefill"]


# -- what holds, kept measured ---------------------------------------------------------------------------
def test_shard_then_reassemble_is_the_identity_on_random_plans():
    rng = torch.Generator().manual_seed(0)
    for case in range(1800):
        n = int(torch.randint(1, 9, (1,), generator=rng))
        docs = int(torch.randint(0, 12, (1,), generator=rng))
        lengths = torch.randint(0, 40, (docs,), generator=rng)
        lengths[torch.rand(docs, generator=rng) < 0.2] = int(torch.randint(0, 2, (1,), generator=rng))
        layout = DocLayout.from_lengths(lengths)
        mask = [Mask.causal(), Mask.full(), Mask.sliding_window(3)][case % 3]
        plan = doccp.plan(layout, n, mask, ["contiguous", "head_tail", "balanced"][case // 3 % 3])
        x = torch.arange(layout.num_tokens)
        back = torch.empty_like(x)
        for r in range(n):
            back[plan.indices(r)] = doccp.shard(x, plan, r)
        assert torch.equal(back, x), (lengths.tolist(), n, plan.strategy)


def determinism_and_nan(rank: int, world_size: int) -> dict:
    layout = DocLayout.from_lengths([40, 3, 25, 9])
    plan = doccp.plan(layout, world_size, Mask.causal(), "head_tail")
    q, k, v, dout = stream(layout)
    q[50, 0, 0] = float("nan")  # document 2 only
    results = {}
    for algorithm in ("allgather", "ring_kv"):
        runs = []
        for _ in range(2):
            leaves = [doccp.shard(x, plan, rank).requires_grad_() for x in (q, k, v)]
            out = doccp.attention(*leaves, plan, algorithm=algorithm)
            out.backward(doccp.shard(dout, plan, rank))
            runs.append([doccp.unshard(t.detach(), plan) for t in (out, *(x.grad for x in leaves))])
        results[algorithm] = runs
    return results


def test_results_are_bitwise_deterministic_and_nan_stays_in_its_document():
    layout = DocLayout.from_lengths([40, 3, 25, 9])
    doc = layout.doc_ids()
    for per_rank in spawn(determinism_and_nan, 3, 3, **QUICK):
        for algorithm, (first, second) in per_rank.items():
            for a, b in zip(first, second, strict=True):
                assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0)), algorithm
            out, dq, dk, dv = first
            assert torch.isnan(out[doc == 2]).any() and not torch.isnan(out[doc != 2]).any(), algorithm
            for grad in (dq, dk, dv):
                assert not torch.isnan(grad[doc != 2]).any(), algorithm


def steady_memory(rank: int, world_size: int, steps: int) -> list[tuple[int, int]]:
    """(peak RSS in KiB, live Python objects after a collection) at two steps of a loop of plans
    and attention calls: leaks through caches show up in the object count, exactly."""
    layout = DocLayout.from_lengths([37, 5, 64, 22])
    marks = []
    for step in range(steps):
        plan = doccp.plan(layout, world_size, Mask.causal(), ["balanced", "head_tail"][step % 2])
        q, k, v, dout = (doccp.shard(x, plan, rank).requires_grad_() for x in stream(layout, step % 7))
        doccp.attention(q, k, v, plan, algorithm=["allgather", "ring_kv"][step % 2]).backward(dout.detach())
        if step in (steps // 4, steps - 1):
            del plan, q, k, v, dout
            gc.collect()
            marks.append((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, len(gc.get_objects())))
    return marks


def test_memory_stays_flat_over_400_steps():
    for (early_rss, early_objects), (late_rss, late_objects) in spawn(steady_memory, 2, 2, 400, timeout_s=120,
                                                                      deadline_s=600):
        assert late_rss - early_rss < 16 * 1024, f"peak RSS grew by {(late_rss - early_rss) / 1024:.1f} MiB"
        assert late_objects - early_objects < 50, f"{late_objects - early_objects} more live objects after 300 steps"
