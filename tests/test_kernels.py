"""Kernels against a float64 dense oracle: a full [Tq, Tk] masked softmax written here,
independent of every backend (including ``reference``)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import visible

from doccp.kernels import BACKENDS, Slices, attend, attend_backward, cpu, cuda, doc_slices
from doccp.kernels.merge import merge_rows
from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.varlen import varlen_attention

CPU_BACKENDS = ["reference", "cpu"]
MASKS = [Mask.causal(), Mask.full(), Mask.sliding_window(5), Mask.sliding_window(4, 3), Mask.chunked(6)]
TOL = {torch.float64: (1e-10, 1e-9), torch.float32: (2e-5, 1e-4), torch.bfloat16: (2.5e-2, 2.5e-2),
       torch.float16: (2.5e-2, 2.5e-2)}  # (out and lse, gradients)
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and "cuda" in BACKENDS),
                                reason="needs a CUDA device and torch flash varlen")


# -- the oracle ------------------------------------------------------------------------------
def band(qpos: torch.Tensor, kpos: torch.Tensor, mask: Mask) -> torch.Tensor:
    return visible(mask, qpos[:, None], kpos[None, :])


def doc_visibility(layout: DocLayout, mask: Mask) -> torch.Tensor:
    ids, pos = layout.doc_ids(), layout.positions()
    return (ids[:, None] == ids[None, :]) & band(pos, pos, mask)


def slice_visibility(slices: Slices, mask: Mask, tq: int, tk: int) -> torch.Tensor:
    vis = torch.zeros(tq, tk, dtype=torch.bool)
    for qs, qe, ks, ke, qp, kp in slices.rows():
        if qe > qs and ke > ks:
            vis[qs:qe, ks:ke] |= band(torch.arange(qp, qp + qe - qs), torch.arange(kp, kp + ke - ks), mask)
    return vis


def dense(q, k, v, vis, scale):
    """float64 masked softmax; rows with no visible key give out 0, lse -inf (and no NaN grads)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q, kk) * scale
    seen = vis.any(-1)
    s = torch.where(vis & seen[:, None], s, torch.where(seen[:, None], float("-inf"), 0.0))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]) * vis
    return torch.einsum("hts,shd->thd", p, vv), torch.where(seen, lse, float("-inf"))


def oracle(q, k, v, vis, scale, dout):
    """out, lse, (dq, dk, dv) in float64 from the inputs as given (already rounded)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = dense(q, k, v, vis, scale)
    grads = torch.autograd.grad(out, (q, k, v), dout.double())
    return out.detach(), lse.detach(), grads


def assert_close(name, got, want, tol):
    got = got.double()
    assert not torch.isnan(got).any(), f"{name} has NaN"
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{name}: -inf in the wrong places"
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:g}"


def qkv(tq, tk, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(tk, hkv, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(tq, hq, d, generator=gen, dtype=torch.float64).to(dtype)


def check_attend(q, k, v, dout, slices, mask, backend, scale=0.3):
    """attend + attend_backward (fed the final out and lse) against the oracle."""
    out, lse = attend(q, k, v, slices, mask, scale, backend)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    grads = attend_backward(dout, q, k, v, out, lse, slices, mask, scale, backend)
    vis = slice_visibility(slices, mask, q.shape[0], k.shape[0])
    want_out, want_lse, want_grads = oracle(q, k, v, vis, scale, dout)
    tol, gtol = TOL[q.dtype]
    assert_close("out", out, want_out, tol)
    assert_close("lse", lse, want_lse, tol)
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert got.dtype == q.dtype
        assert_close(name, got, want, gtol)
    return out, lse


# -- varlen_attention: whole documents ---------------------------------------------------------
LENGTHS = [[0, 1, 37, 0, 5, 120, 1, 2, 64], [200], [3, 0, 0, 90, 17, 1]]
CASES = [(mask, g, d) for mask in MASKS for g, d in ((1, 32), (2, 64), (4, 128))]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("mask", "group", "dim"), CASES, ids=[f"{m}-g{g}-d{d}" for m, g, d in CASES])
def test_varlen_fp32(backend, mask, group, dim):
    check_varlen(backend, torch.float32, mask, group, dim, LENGTHS[(group + dim) % 3])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_varlen_dtypes(backend, dtype, mask):
    check_varlen(backend, dtype, mask, 2, 64, LENGTHS[0])


def check_varlen(backend, dtype, mask, group, dim, lengths, device="cpu"):
    layout = DocLayout.from_lengths(lengths)
    q, k, v, dout = qkv(layout.num_tokens, layout.num_tokens, 2 * group, 2, dim, dtype)
    q, k, v, dout = (x.to(device) for x in (q, k, v, dout))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = varlen_attention(*leaves, layout, mask, return_lse=True, backend=backend)
    out.backward(dout)
    want_out, want_lse, want_grads = oracle(q.cpu(), k.cpu(), v.cpu(), doc_visibility(layout, mask),
                                            dim ** -0.5, dout.cpu())
    tol, gtol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close("out", out.cpu(), want_out, tol)
    assert_close("lse", lse.cpu(), want_lse, tol)
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, want_grads, strict=True):
        assert_close(name, leaf.grad.cpu(), want, gtol)


@pytest.mark.parametrize("mask", [Mask.causal(), Mask.sliding_window(300, 40)], ids=str)
def test_varlen_long_document_default_backend(mask):
    check_varlen("auto", torch.float32, mask, 2, 64, [700, 3, 300])


# -- slices: chunks of documents in every relation ---------------------------------------------
def chunked_slices(rng: random.Random, lengths, num_chunks: int, keep: float):
    """Cut documents into chunks, shuffle them into a q buffer and (independently) a k
    buffer, and emit one slice per (q chunk, k chunk) pair of a document (kept with
    probability ``keep``): before, same, after and overlapping-window relations all occur,
    and most query rows get several slices."""
    def chunks():
        out = []
        for doc, n in enumerate(lengths):
            cuts = sorted(rng.sample(range(1, n), min(n - 1, num_chunks - 1))) if n > 1 else []
            bounds = [0, *cuts, n]
            out += [(doc, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
        rng.shuffle(out)
        row, placed = rng.randrange(3), []  # a few rows in no slice at the start
        for doc, a, b in out:
            placed.append((doc, a, b, row))
            row += b - a
        return placed, row + rng.randrange(3)

    qc, tq = chunks()
    kc, tk = chunks()
    rows = [(qr, qr + qb - qa, kr, kr + kb - ka, qa, ka)
            for qd, qa, qb, qr in qc for kd, ka, kb, kr in kc if qd == kd and rng.random() < keep]
    rng.shuffle(rows)
    return (Slices.of(*zip(*rows, strict=True)) if rows else Slices.empty()), tq, tk


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=12, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), mask=st.sampled_from(MASKS + [Mask(None, 3), Mask(6, None)]),
       group=st.sampled_from([1, 2, 4]), keep=st.sampled_from([1.0, 0.7]),
       dtype=st.sampled_from([torch.float32, torch.float64]), small=st.booleans())
def test_slices_every_relation(backend, seed, mask, group, keep, dtype, small):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 7, 16, 40, 90]) for _ in range(rng.randrange(1, 5))]
    slices, tq, tk = chunked_slices(rng, lengths, rng.randrange(1, 5), keep)
    q, k, v, dout = qkv(tq, tk, 2 * group, 2, 32, dtype, seed % 1000)
    saved = cpu.BAND_BLOCK, cpu.CAUSAL_MIN, cpu.MASK_MAX
    if small:  # tiny row blocks, and zones instead of masks, even for these small slices
        cpu.BAND_BLOCK, cpu.CAUSAL_MIN, cpu.MASK_MAX = rng.randrange(1, 6), rng.randrange(1, 6), rng.randrange(0, 40)
    try:
        check_attend(q, k, v, dout, slices, mask, backend)
    finally:
        cpu.BAND_BLOCK, cpu.CAUSAL_MIN, cpu.MASK_MAX = saved


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_slice_relations_by_hand(backend):
    """One document of 24 tokens; q holds positions 8..15, k the whole document."""
    q, k, v, dout = qkv(8, 24, 4, 2, 32, torch.float32)
    cases = {  # name: (slices, mask)
        "late chunk vs prefix": ([(0, 8, 0, 8, 8, 0)], Mask.causal()),
        "chunk vs itself": ([(0, 8, 8, 16, 8, 8)], Mask.causal()),
        "chunk vs later chunk": ([(0, 8, 16, 24, 8, 16)], Mask.full()),
        "later chunk, causal": ([(0, 8, 16, 24, 8, 16)], Mask.causal()),  # nothing visible
        "window across borders": ([(0, 8, 0, 8, 8, 0), (0, 8, 8, 16, 8, 8), (0, 8, 16, 24, 8, 16)],
                                  Mask.sliding_window(5, 2)),
        "window far behind": ([(0, 8, 0, 4, 8, 0)], Mask.sliding_window(3)),  # nothing visible
    }
    for name, (rows, mask) in cases.items():
        out, lse = check_attend(q, k, v, dout, Slices.of(*zip(*rows, strict=True)), mask, backend)
        if "nothing" in name or name in ("later chunk, causal", "window far behind"):
            assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all()), name


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backward_accumulates_over_slices(backend):
    """Backward slice by slice, each fed the FINAL merged out and lse, sums to the exact
    gradient: what a distributed backward does without recomputing the forward."""
    rng = random.Random(3)
    slices, tq, tk = chunked_slices(rng, [50, 31, 64], 3, 1.0)
    q, k, v, dout = qkv(tq, tk, 4, 2, 64, torch.float64)
    mask = Mask.sliding_window(20)
    out, lse = attend(q, k, v, slices, mask, 0.2, backend)
    total = [torch.zeros_like(x) for x in (q, k, v)]
    for i in range(len(slices)):
        one = slices.select(slice(i, i + 1))
        for acc, g in zip(total, attend_backward(dout, q, k, v, out, lse, one, mask, 0.2, backend), strict=True):
            acc += g
    _, _, want = oracle(q, k, v, slice_visibility(slices, mask, tq, tk), 0.2, dout)
    for name, got, w in zip(("dq", "dk", "dv"), total, want, strict=True):
        assert_close(name, got, w, 1e-10)


def test_empty_inputs():
    q, k, v, dout = qkv(5, 4, 2, 1, 8, torch.float32)
    for backend in CPU_BACKENDS:
        out, lse = attend(q, k, v, Slices.empty(), Mask.causal(), None, backend)
        assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isneginf(lse).all())
        grads = attend_backward(dout, q, k, v, out, lse, Slices.empty(), Mask.causal(), None, backend)
        assert all(not g.any() for g in grads)


# -- the cpu backend's machinery --------------------------------------------------------------
def test_pieces_cover_the_band_exactly(monkeypatch):
    """Every visible pair lands in exactly one mask-free piece, for all small geometries
    (geometry g owns rows and keys [8g, 8g+8) of the buffers; all are cut in one call)."""
    geometries = [(m, n, qp, kp) for m in range(1, 6) for n in range(1, 6) for qp in range(6) for kp in range(6)]
    g = torch.tensor(geometries)
    base = torch.arange(len(geometries)) * 8
    s = Slices(base + 2, base + 2 + g[:, 0], base + 1, base + 1 + g[:, 1], g[:, 2], g[:, 3])
    for mask, mask_max in itertools.product(
            [Mask.causal(), Mask.full(), Mask(0, 0), Mask(2), Mask(1, 2), Mask(None, 1), Mask(3, None)], [1 << 22, 4]):
        monkeypatch.setattr(cpu, "MASK_MAX", mask_max)  # small: zones wherever they are valid
        want = torch.zeros(len(geometries), 8, 8, dtype=torch.int64)
        for x, (m, n, qp, kp) in enumerate(geometries):
            want[x, 2:2 + m, 1:1 + n] = band(torch.arange(qp, qp + m), torch.arange(kp, kp + n), mask)
        assert torch.equal(piece_cover(cpu.Calls.of(s, mask), len(geometries)), want), f"{mask}"


def piece_cover(pieces, blocks):
    """How often each (row, key) of each 8x8 block is covered by the pieces."""
    cover = torch.zeros(blocks, 8, 8, dtype=torch.int64)
    cols = (pieces.q0, pieces.k0, pieces.m, pieces.n, pieces.kind, pieces.lo, pieces.hi)
    for q0, k0, m, n, kind, lo, hi in zip(*(x.tolist() for x in cols), strict=True):
        d = torch.arange(n)[None, :] - torch.arange(m)[:, None]
        vis = {cpu.RECT: d == d, cpu.CAUSAL: d <= 0, cpu.MASKED: (d >= lo) & (d <= hi)}[kind]
        assert vis.any(1).all(), "a piece row sees no key (the kernel would return lse 0 there)"
        assert q0 // 8 == k0 // 8 == (q0 + m - 1) // 8 == (k0 + n - 1) // 8
        cover[q0 // 8, q0 % 8:q0 % 8 + m, k0 % 8:k0 % 8 + n] += vis.long()
    return cover


def test_band_blocks_and_causal_split(monkeypatch):
    """Small thresholds exercise the row blocks of windowed slices and rectangle + causal pieces."""
    monkeypatch.setattr(cpu, "BAND_BLOCK", 3)
    monkeypatch.setattr(cpu, "CAUSAL_MIN", 4)
    monkeypatch.setattr(cpu, "MASK_MAX", 10)
    rng = random.Random(5)
    slices, tq, tk = chunked_slices(rng, [60, 45], 2, 1.0)
    q, k, v, dout = qkv(tq, tk, 4, 1, 32, torch.float32)
    for mask in (Mask.sliding_window(7), Mask.sliding_window(5, 4), Mask.causal(), Mask(9, None)):
        check_attend(q, k, v, dout, slices, mask, "cpu")


def test_cpu_batches_same_shape_slices(monkeypatch):
    """300 documents of 1..8 tokens cost at most 8 forward and 8 backward kernel calls."""
    calls = []
    for name in ("_FORWARD", "_BACKWARD"):
        op = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _op=op, _n=name, **kw: calls.append(_n) or _op(*a, **kw))
    rng = random.Random(0)
    layout = DocLayout.from_lengths([rng.randrange(1, 9) for _ in range(300)])
    q, k, v, dout = qkv(layout.num_tokens, layout.num_tokens, 4, 2, 32, torch.float32)
    check_attend(q, k, v, dout, doc_slices(layout.cu_seqlens), Mask.causal(), "cpu")
    assert calls.count("_FORWARD") <= 8 and calls.count("_BACKWARD") <= 8


def test_cpu_runs_long_key_slices_one_by_one(monkeypatch):
    """Equal-shape pieces with SOLO_KEYS keys or more run one call each (no gathered copy of
    their keys), and the result stays exact."""
    calls = []
    for name in ("_FORWARD", "_BACKWARD"):
        op = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _op=op, _n=name, **kw: calls.append((_n, a[2].shape[0])) or
                            _op(*a, **kw))
    monkeypatch.setattr(cpu, "SOLO_KEYS", 8)
    layout = DocLayout.from_lengths([8, 8, 8, 4, 4])  # three of length 8: solo; two of 4: one batch
    q, k, v, dout = qkv(layout.num_tokens, layout.num_tokens, 4, 2, 32, torch.float32)
    check_attend(q, k, v, dout, doc_slices(layout.cu_seqlens), Mask.full(), "cpu")
    for name in ("_FORWARD", "_BACKWARD"):
        assert sorted(batch for n, batch in calls if n == name) == [1, 1, 1, 2]


def test_merge_rows_is_nan_free():
    rows = torch.tensor([0, 0, 2])
    out = torch.randn(3, 2, 4)
    lse = torch.tensor([[0.5, float("-inf")], [1.0, float("-inf")], [float("-inf"), 2.0]])
    merged, merged_lse = merge_rows(rows, out, lse, 4)
    assert not torch.isnan(merged).any() and not torch.isnan(merged_lse).any()
    assert torch.isneginf(merged_lse[1]).all() and torch.isneginf(merged_lse[3]).all()
    assert torch.allclose(merged_lse[0, 0], torch.logaddexp(torch.tensor(0.5), torch.tensor(1.0)))


# -- the cuda backend -------------------------------------------------------------------------
def flash_visibility(cu_q, cu_k, max_q, max_k, window, tq, tk):
    """Flash varlen's mask as documented: per sequence, bottom-right aligned window, a
    window side ``>= max_k`` read as unbounded."""
    wl, wr = (-1 if w >= max_k else w for w in window)
    vis = torch.zeros(tq, tk, dtype=torch.bool)
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        m, n = q1 - q0, k1 - k0
        assert m <= max_q and n <= max_k
        i, j = torch.arange(m)[:, None], torch.arange(n)[None, :]
        ok = torch.ones(m, n, dtype=torch.bool)
        if wl >= 0:
            ok &= j >= n - m + i - wl
        if wr >= 0:
            ok &= j <= n - m + i + wr
        vis[q0:q1, k0:k1] = ok
    return vis


def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux, scale, window_size, enable_gqa):
    """CPU float64 stand-in for torch's flash varlen_attn: lse is +inf on rows with no key."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and return_aux.lse and enable_gqa == (q.shape[1] != k.shape[1])
    vis = flash_visibility(cu_q, cu_k, max_q, max_k, window_size, q.shape[0], k.shape[0])
    out, lse = dense(q.double(), k.double(), v.double(), vis, scale)
    return out.to(q.dtype), lse.float().masked_fill(torch.isneginf(lse), float("inf"))


def fake_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state,
                        unused, *, scale, window_size_left, window_size_right):
    """CPU stand-in for aten._flash_attention_backward: P = exp(S - lse) from the given lse."""
    window = (-1, 0) if is_causal else (window_size_left, window_size_right)
    vis = flash_visibility(cu_q, cu_k, max_q, max_k, window, q.shape[0], k.shape[0])
    g = q.shape[1] // k.shape[1]
    q, k, v, dout, out = (x.double() for x in (q, k, v, dout, out))
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    p = torch.exp(torch.einsum("thd,shd->hts", q, kk) * scale - lse.double()[..., None]) * vis
    ds = p * (torch.einsum("thd,shd->hts", dout, vv) - (dout * out).sum(-1).T[..., None]) * scale
    dq = torch.einsum("hts,shd->thd", ds, kk)
    dk = torch.einsum("hts,thd->shd", ds, q).unflatten(1, (k.shape[1], g)).sum(2)
    dv = torch.einsum("hts,thd->shd", p, dout).unflatten(1, (k.shape[1], g)).sum(2)
    return dq.float(), dk.float(), dv.float()


def test_cuda_slice_logic_with_fake_flash(monkeypatch):
    """The cuda backend's grouping, window arithmetic, lse conventions and merging, run on
    CPU with the two flash kernels replaced by float64 models of their semantics. (The real
    kernels are only exercised by the tests marked needs_cuda.)"""
    monkeypatch.setattr(cuda, "_check", lambda q: None)
    aux_request = lambda lse: type("Aux", (), {"lse": lse})()  # noqa: E731
    monkeypatch.setattr(cuda, "_varlen", lambda: (fake_varlen_attn, aux_request))
    monkeypatch.setattr(cuda, "_FLASH_BACKWARD", fake_flash_backward)
    monkeypatch.setitem(BACKENDS, "fake_cuda", (cuda.attend, cuda.attend_backward))
    for seed in range(5):
        rng = random.Random(seed)
        slices, tq, tk = chunked_slices(rng, [rng.choice([1, 9, 30, 50]) for _ in range(3)], 3, 0.8)
        q, k, v, dout = qkv(tq, tk, 4, 2, 16, torch.float32, seed)
        for mask in MASKS + [Mask(None, 3), Mask(6, None), Mask(40, 2)]:
            check_attend(q, k, v, dout, slices, mask, "fake_cuda")
    layout = DocLayout.from_lengths([0, 5, 1, 12])  # the single-call path
    q, k, v, dout = qkv(18, 18, 4, 1, 16, torch.float32)
    for mask in MASKS:
        check_attend(q, k, v, dout, doc_slices(layout.cu_seqlens), mask, "fake_cuda")


@needs_cuda
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_varlen(mask, dtype):
    check_varlen("cuda", dtype, mask, 2, 64, LENGTHS[0], device="cuda")


@needs_cuda
@pytest.mark.parametrize("mask", MASKS + [Mask(None, 3), Mask(6, None)], ids=str)
def test_cuda_slices(mask):
    for seed in range(4):
        rng = random.Random(seed)
        slices, tq, tk = chunked_slices(rng, [1, 30, 70, 9], 3, 0.8)
        q, k, v, dout = (x.cuda() for x in qkv(tq, tk, 4, 2, 64, torch.bfloat16, seed))
        out, lse = attend(q, k, v, slices, mask, 0.125, "cuda")
        grads = attend_backward(dout, q, k, v, out, lse, slices, mask, 0.125, "cuda")
        vis = slice_visibility(slices, mask, tq, tk)
        want_out, want_lse, want_grads = oracle(q.cpu(), k.cpu(), v.cpu(), vis, 0.125, dout.cpu())
        assert_close("out", out.cpu(), want_out, 2.5e-2)
        assert_close("lse", lse.cpu(), want_lse, 2.5e-2)
        for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
            assert_close(name, got.cpu(), want, 2.5e-2)
