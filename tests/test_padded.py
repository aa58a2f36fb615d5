"""Padded per-document CP: seed 000's shapes, shard/unshard, gradients, exact attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import visible

import doccp
from doccp.interop.padded import padded_plan
from doccp.launch import WorkerError, spawn

SEED_CASES = [  # (doc_lens, world_size, padded L, expected local shape[:2])
    ([16, 12, 18], 2, 20, (3, 9)),
    ([48, 56, 58, 35], 2, 58, (4, 29)),
    ([158, 127, 160, 155], 4, 160, (4, 40)),
]


@pytest.mark.parametrize("lens, n, length, shape", SEED_CASES)
def test_seed_shapes(lens, n, length, shape):
    x = torch.randn(len(lens), length, 8)
    total = torch.zeros(len(lens), dtype=torch.int64)
    for rank in range(n):
        local = doccp.shard_padded(x, lens, rank, n)
        assert tuple(local.x.shape) == (*shape, 8)
        total += local.lengths
    assert total.tolist() == lens


@pytest.mark.parametrize("lens, n", [([16, 12, 18], 2), ([1, 0, 7, 30, 5], 3), ([158, 127, 160, 155], 4)])
def test_shards_partition_each_row_in_head_tail_order(lens, n):
    length = max(lens) + 2
    pos = torch.arange(length).expand(len(lens), length)[..., None].float()  # value = position in row
    seen = [[] for _ in lens]
    for rank in range(n):
        local = doccp.shard_padded(pos, lens, rank, n)
        expect = padded_plan(lens, n).positions(rank)
        for b, m in enumerate(local.lengths.tolist()):
            row = local.x[b, :, 0]
            assert row[:m].tolist() == expect[b, :m].tolist()
            assert not row[m:].any()  # zero padding
            seen[b] += row[:m].long().tolist()
            # head chunk r then tail chunk 2N-1-r: at most one jump within the row
            assert int((row[:m].diff() != 1).sum()) <= 1
    assert [sorted(s) for s in seen] == [list(range(m)) for m in lens]


def test_shard_padded_gradient_scatters_to_taken_positions():
    lens, n = [5, 9, 2], 2
    x = torch.randn(3, 11, 2, dtype=torch.float64, requires_grad=True)
    for rank in range(n):
        local = doccp.shard_padded(x, lens, rank, n)
        w = torch.randn_like(local.x)
        (grad,) = torch.autograd.grad((local.x * w).sum(), x)
        taken = torch.zeros(3, 11, dtype=torch.bool)
        for doc, start, end in padded_plan(lens, n).plan.pieces(rank):
            taken[doc, start:end] = True
        for b in range(3):
            m = int(local.lengths[b])
            torch.testing.assert_close(grad[b][taken[b]], w[b, :m])
        assert not grad[~taken].any()
        torch.autograd.gradcheck(lambda t, r=rank: doccp.shard_padded(t, lens, r, n).x, (x,))


def test_single_process_round_trip_and_attention():
    lens = [6, 3, 8]
    x = torch.randn(3, 9, 4, 8, dtype=torch.float64)
    local = doccp.shard_padded(x, lens, 0, 1)
    assert torch.equal(doccp.unshard_padded(local.x, lens, max_len=9)[:, :8], _zero_padding(x, lens)[:, :8])
    out = doccp.padded_attention(local.x, local.x, local.x, lens)
    torch.testing.assert_close(out, _zero_padding(dense_reference(x, x, x, lens, doccp.Mask.causal()), lens)[:, :8])


@pytest.mark.parametrize("call, error, match", [
    (lambda x: doccp.shard_padded(x[0], [3, 4], 0, 2), ValueError, r"must have shape \[2, L >= 4"),
    (lambda x: doccp.shard_padded(x[:, :3], [3, 4], 0, 2), ValueError, "L >= 4"),
    (lambda x: doccp.shard_padded(x, [3, 4, 1], 0, 2), ValueError, r"\[3, L >= 4"),
    (lambda x: doccp.shard_padded(x, [3, -1], 0, 2), ValueError, "doc_lens must be >= 0"),
    (lambda x: doccp.shard_padded(x, [3.0, 4.0], 0, 2), TypeError, "integers"),
    (lambda x: doccp.shard_padded(x, [3, 4], 2, 2), ValueError, r"rank must be in \[0, 2\)"),
    (lambda x: doccp.shard_padded(x, [3, 4], 0, 0), ValueError, r"world_size must be in \[1, "),
    (lambda x: doccp.shard_padded(x.tolist(), [3, 4], 0, 2), TypeError, "torch.Tensor"),
    (lambda x: doccp.unshard_padded(x, [3, 4]), ValueError, r"\[2, 4, \.\.\.\]"),
    (lambda x: doccp.unshard_padded(x.tolist(), [3, 4]), TypeError, "x_local must be a torch.Tensor"),
    (lambda x: doccp.padded_attention("q", x, x, [3, 4]), TypeError, "q must be a torch.Tensor"),
    (lambda x: doccp.unshard_padded(x[:, :4], [3, 4], max_len=3), ValueError, "max_len"),
    (lambda x: doccp.padded_attention(x[:, :4, None], x[:, :4], x[:, :4], [3, 4]), ValueError, "all be 3-D or all 4-D"),
    (lambda x: doccp.padded_attention(x, x, x, [3, 4]), ValueError, r"q must have shape \[2, 4"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(2, 5, 6))


# -- helpers ---------------------------------------------------------------------------------

def dense_reference(q, k, v, lens, mask):
    """Row-by-row dense attention in float64 on padded ``[B, L, H, D]`` (independent oracle)."""
    # (padding is zeros that still depend on q, k and v: a batch of empty rows backpropagates zeros)
    anchor = sum(t.double().sum() for t in (q, k, v)) * 0
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64) + anchor
    group = q.shape[2] // k.shape[2]
    for b, m in enumerate(lens):
        if m == 0:
            continue
        qb = q[b, :m].double().transpose(0, 1)
        kb, vb = (t[b, :m].double().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        i = torch.arange(m)
        seen = visible(mask, i[:, None], i[None, :])
        s = (qb @ kb.transpose(1, 2)) / q.shape[-1] ** 0.5
        out[b, :m] = (s.masked_fill(~seen, float("-inf")).softmax(-1) @ vb).transpose(0, 1)
    return out


def _assert_close(a, b, what, tol=1e-9):
    """float64 comparison without torch.testing (whose first call imports DTensor: seconds per rank)."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    a, b = a.detach(), b.detach()
    err = float((a - b).abs().max()) if a.numel() else 0.0
    assert err <= tol * max(1.0, float(b.abs().max()) if b.numel() else 0.0), f"{what}: max abs error {err:.2e}"


def _zero_padding(x, lens):
    keep = torch.arange(x.shape[1])[None, :] < torch.tensor(lens)[:, None]
    return x * keep.reshape(*keep.shape, *([1] * (x.dim() - 2)))


# -- distributed: one spawned job per world size runs every case -----------------------------

ATTN_CASES = [  # (doc_lens, padded L, Hq, Hkv, D, mask, algorithm, one_head)
    ([16, 12, 18], 20, 2, 2, 8, doccp.Mask.causal(), "auto", False),
    ([48, 56, 58, 35], 58, 4, 2, 8, doccp.Mask.causal(), "ring_kv", False),
    ([1, 0, 7, 30, 5], 31, 2, 1, 4, doccp.Mask.full(), "allgather", False),
    ([23, 40, 2], 40, 2, 2, 8, doccp.Mask.sliding_window(5), "auto", False),
    ([16, 12, 18], 18, 1, 1, 8, doccp.Mask.causal(), "auto", True),  # seed's [B, S, D] form
]


def run_cases(rank: int, n: int, cases: list[tuple] = ATTN_CASES) -> int:
    """Worker: every case (``ATTN_CASES``' form) and a bad shape on one rank; returns the checks passed."""
    gen = torch.Generator().manual_seed(7)
    checked = 0
    for lens, length, hq, hkv, d, mask, algorithm, one_head in cases:
        b = len(lens)
        full = [torch.randn(b, length, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv)]
        if one_head:
            full = [t[:, :, 0] for t in full]
        dout = torch.randn(b, length, *full[0].shape[2:], generator=gen, dtype=torch.float64)

        # unshard_padded inverts shard_padded (padding comes back as zeros)
        local = doccp.shard_padded(full[0], lens, rank, n)
        back = doccp.unshard_padded(local.x, lens, max_len=length)
        assert torch.equal(back, _zero_padding(full[0], lens))

        # exact attention, forward and gradients, against the dense float64 oracle
        leaves = [t.clone().requires_grad_() for t in full]
        q, k, v = (doccp.shard_padded(t, lens, rank, n).x for t in leaves)
        out = doccp.padded_attention(q, k, v, lens, mask=mask, algorithm=algorithm)
        (out * doccp.shard_padded(dout, lens, rank, n).x).sum().backward()
        grads = [t.grad for t in leaves]
        for g in grads:
            dist.all_reduce(g)  # each rank holds the gradient of its own tokens

        ref_leaves = [t.clone().requires_grad_() for t in full]
        unsq = [t.unsqueeze(2) if one_head else t for t in ref_leaves]
        ref = dense_reference(*unsq, lens, mask)
        ref = ref.squeeze(2) if one_head else ref
        (ref * dout).sum().backward()
        _assert_close(out, doccp.shard_padded(ref, lens, rank, n).x.detach(), f"out {lens} {mask}")
        for name, g, r in zip("qkv", grads, ref_leaves, strict=True):
            _assert_close(g, _zero_padding(r.grad, lens), f"d{name} {lens} {mask}")

        # lse comes back padded with -inf
        _, lse = doccp.padded_attention(q.detach(), k.detach(), v.detach(), lens, mask=mask, return_lse=True)
        assert lse.shape == out.shape[:-1]
        pad = torch.arange(lse.shape[1])[None, :] >= local.lengths[:, None]
        assert torch.isneginf(lse[pad]).all() and torch.isfinite(lse[~pad]).all()
        checked += 1

    # a bad shape on one rank raises on every rank instead of hanging
    good = padded_plan([10, 6], n).max_local
    q = torch.randn(2, good + 1 if rank == 1 else good, 2, 4)
    try:
        doccp.padded_attention(q, q, q, [10, 6])
    except ValueError as e:
        assert "q must have shape" in str(e)
        checked += 1
    return checked


@pytest.mark.parametrize("n", [2, 3])
def test_padded_attention_exact_across_ranks(n):
    try:
        results = spawn(run_cases, n, n, threads=1)
    except WorkerError as e:  # show the worker's traceback in the pytest report
        pytest.fail(str(e))
    assert results == [len(ATTN_CASES) + 1] * n
