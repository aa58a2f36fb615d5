"""shard / unshard: values, gradients and errors, with real gloo groups for unshard.

Starting a process group costs seconds, so each world size runs ONE spawned job that loops
over every case and reports back; the parent test only asserts on what the ranks saw.
"""

from __future__ import annotations

import pytest
import torch

from doccp import DocLayout, Mask, plan, shard, unshard
from doccp.launch import spawn
from doccp.plan import STRATEGIES

# Unequal local sizes (T % N != 0 for N = 2, 3), zero-length, 1-token, whole-stream documents.
LAYOUTS = [[5, 0, 1, 9, 2], [1], [13], [0, 4, 0], [7, 11, 1, 1, 3, 6], []]
# (full shape with T at `dim`, dim, dtype): trailing shapes, non-leading and negative dims.
TENSORS = [
    ((None,), 0, torch.float32),
    ((None, 3), 0, torch.float64),
    ((None, 2, 3), 0, torch.bfloat16),
    ((2, None, 4), 1, torch.float16),
    ((3, None), -1, torch.int64),
    ((None, 2), -2, torch.bool),
    ((2, 1, None), 2, torch.complex64),
]


def full_tensor(shape: tuple, num_tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The same tensor on every rank (seeded), with ``num_tokens`` where ``shape`` has None."""
    shape = tuple(num_tokens if s is None else s for s in shape)
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g, dtype=dtype)


def cases():
    for i, lengths in enumerate(LAYOUTS):
        for strategy in sorted(STRATEGIES):
            for j, (shape, dim, dtype) in enumerate(TENSORS):
                yield DocLayout.from_lengths(lengths), strategy, shape, dim, dtype, 100 * i + j


# -- single process ----------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shard_selects_the_plan_tokens(n):
    for layout, strategy, shape, dim, dtype, seed in cases():
        p = plan(layout, n, Mask.causal(), strategy)
        x = full_tensor(shape, layout.num_tokens, dtype, seed)
        parts = [shard(x, p, r, dim=dim) for r in range(n)]
        for r, part in enumerate(parts):
            assert part.dtype == dtype and torch.equal(part, x.index_select(dim, p.indices(r)))
        order = torch.cat([p.indices(r) for r in range(n)])
        restored = torch.empty_like(x).index_copy_(dim, order, torch.cat(parts, dim))
        assert torch.equal(restored, x)


def test_shard_gradient():
    p = plan(DocLayout.from_lengths([5, 1, 0, 6]), 3)
    x = torch.randn(2, 12, 3, dtype=torch.float64, requires_grad=True)
    for r in range(3):
        assert torch.autograd.gradcheck(lambda t, r=r: shard(t, p, r, dim=1), (x,))
    w = torch.randn(12, 3, dtype=torch.float64)
    x1 = x[0].detach().requires_grad_()
    (shard(x1, p, 1) * shard(w, p, 1)).sum().backward()
    expected = torch.zeros_like(w)
    expected[p.indices(1)] = w[p.indices(1)]
    assert torch.equal(x1.grad, expected)


def test_unshard_without_a_group_checks_the_plan_size():
    with pytest.raises(ValueError, match="world_size=2, but no process group is initialised"):
        unshard(torch.zeros(4), plan(DocLayout.from_lengths([3, 4]), 2))


def test_unshard_of_one_rank_needs_no_group():
    """world_size=1: unshard is the inverse permutation, no process group needed."""
    p = plan(DocLayout.from_lengths([3, 4]), 1)
    x = torch.randn(7, 2)
    assert torch.equal(unshard(shard(x, p, 0), p), x)


@pytest.mark.parametrize("call, error, match", [
    (lambda p: shard([1, 2], p, 0), TypeError, "x must be a torch.Tensor"),
    (lambda p: shard(torch.zeros(7), "plan", 0), TypeError, "plan must be a doccp.Plan"),
    (lambda p: shard(torch.zeros(6), p, 0), ValueError, "layout holds 7 tokens"),
    (lambda p: shard(torch.zeros(7, 2), p, 0, dim=1), ValueError, "dimension 1 must match"),
    (lambda p: shard(torch.zeros(7), p, 0, dim=1), ValueError, "dim=1 is out of range"),
    (lambda p: shard(torch.zeros(7), p, 0, dim=-2), ValueError, "dim=-2 is out of range"),
    (lambda p: shard(torch.zeros(7), p, 2), ValueError, r"rank must be in \[0, 2\)"),
    (lambda p: shard(torch.zeros(7), p, -1), ValueError, "rank must be in"),
    (lambda p: shard(torch.zeros(7), p, 1.0), TypeError, "rank must be an int"),
    (lambda p: unshard(torch.zeros(3).numpy(), p), TypeError, "x_local must be a torch.Tensor"),
    (lambda p: unshard(torch.zeros(3), None), TypeError, "plan must be a doccp.Plan"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(plan(DocLayout.from_lengths([3, 4]), 2))


# -- real gloo groups --------------------------------------------------------------------
def _errors(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _distributed_worker(rank: int, n: int) -> dict:
    """Every unshard case for one rank of an ``n``-rank gloo group (runs in a spawned process)."""
    round_trips = 0
    for layout, strategy, shape, dim, dtype, seed in cases():
        p = plan(layout, n, Mask.causal(), strategy)
        x = full_tensor(shape, layout.num_tokens, dtype, seed)
        local = shard(x, p, rank, dim=dim)
        assert local.shape[dim] == p.local_sizes[rank]
        out = unshard(local, p, dim=dim)
        assert out.dtype == dtype and torch.equal(out, x), (layout, strategy, shape, dim, dtype)
        round_trips += 1

    # Gradients: unshard's backward is the rank's own slice; through shard it lands on own tokens.
    gradients = 0
    for layout, strategy, shape, dim, dtype, seed in cases():
        if dtype != torch.float64:
            continue
        p = plan(layout, n, Mask.sliding_window(3), strategy)
        w = full_tensor(shape, layout.num_tokens, dtype, seed + 1)
        x_local = shard(full_tensor(shape, layout.num_tokens, dtype, seed), p, rank, dim).requires_grad_()
        (unshard(x_local, p, dim=dim) * w).sum().backward()
        assert torch.equal(x_local.grad, shard(w, p, rank, dim))
        x = full_tensor(shape, layout.num_tokens, dtype, seed).requires_grad_()
        (unshard(shard(x, p, rank, dim), p, dim=dim) * w).sum().backward()
        own = torch.zeros(layout.num_tokens, dtype=torch.bool)
        own[p.indices(rank)] = True
        own = own.reshape([-1 if d == dim % x.dim() else 1 for d in range(x.dim())])
        assert torch.equal(x.grad, torch.where(own, w, torch.zeros_like(w)))
        gradients += 1

    # Errors must reach every rank (no hang). Plans stay referenced so that comm.agree's
    # validation cache (keyed by id(plan)) never sees a recycled id.
    layout = DocLayout.from_lengths([5, 0, 1, 9, 2])
    wrong_size, good = plan(layout, n + 1), plan(layout, n)
    x = torch.arange(layout.num_tokens, dtype=torch.float32)
    bad_rank = n - 1
    errors = {
        "group size": _errors(lambda: unshard(shard(x, wrong_size, rank), wrong_size)),
        "local size": _errors(lambda: unshard(shard(x, good, rank)[: -1 if rank == bad_rank else None], good)),
    }
    assert torch.equal(unshard(shard(x, good, rank), good), x)  # the group still works afterwards
    return {"round_trips": round_trips, "gradients": gradients, "errors": errors}


@pytest.mark.parametrize("n", [2, 3])
def test_unshard_in_a_gloo_group(n):
    results = spawn(_distributed_worker, n, n, timeout_s=60)
    expected = len(LAYOUTS) * len(STRATEGIES) * len(TENSORS)
    bad_rank = n - 1
    for rank, res in enumerate(results):
        assert res["round_trips"] == expected
        assert res["gradients"] == len(LAYOUTS) * len(STRATEGIES)
        errors = res["errors"]
        assert errors["group size"].startswith(f"ValueError: the plan is for world_size={n + 1} but the process "
                                               f"group has {n} ranks; build the plan with world_size={n}")
        assert errors["local size"] is not None and errors["local size"].startswith("ValueError: x_local has")
        assert ("reported by rank" in errors["local size"]) == (rank != bad_rank)
