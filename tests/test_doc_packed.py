"""doc_packed_attn: parity with a dense float64 oracle, custom-op contract, compile, DTensor rules."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import visible

from doccp import Mask, doc_packed_attn, kernels
from doccp.interop.doc_packed import doc_packed_attn_backward_op, doc_packed_attn_op
from doccp.launch import spawn

S = 12
#: trailing zero-length docs; one doc spanning S; docs 1, 3, 0 (in the middle), 8; docs 2, 7, 3
CU_ROWS = torch.tensor([[0, 5, 12, 12, 12], [0, 12, 12, 12, 12], [0, 1, 4, 4, 12], [0, 2, 9, 12, 12]],
                       dtype=torch.int32)
MASKS = [Mask.causal(), Mask.full(), Mask.sliding_window(3), Mask.sliding_window(2, 1), Mask.chunked(4)]


def oracle(q, k, v, cu_rows, mask: Mask, scale: float | None = None):
    """Dense float64 ``[B, S, S]`` masked softmax: out ``[B, S, Hq, D]``, lse ``[B, Hq, S]``."""
    q, k, v = (t.double() for t in (q, k, v))
    b, s, hq, d = q.shape
    k, v = (t.repeat_interleave(hq // t.shape[2], dim=2) for t in (k, v))
    cu = cu_rows.long()
    t = torch.arange(s).expand(b, s).contiguous()
    doc = torch.searchsorted(cu, t, right=True) - 1
    pos = t - cu.gather(1, doc)
    seen = (doc[:, :, None] == doc[:, None, :]) & visible(mask, pos[:, :, None], pos[:, None, :])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(d) if scale is None else scale)
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v), scores.logsumexp(-1)


def inputs(hq: int = 4, hkv: int = 2, d: int = 8, b: int = 4, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, S, h, d, generator=g, dtype=dtype).requires_grad_() for h in (hq, hkv, hkv))
    return q, k, v, CU_ROWS[:b]


def grads(*tensors):
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


# -- parity -----------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_matches_dense_oracle(mask: Mask, heads: tuple[int, int]):
    q, k, v, cu = inputs(*heads)
    scale = 0.3 if heads == (2, 2) else None
    g = torch.Generator().manual_seed(1)
    w_out, w_lse = torch.randn(4, S, heads[0], 8, generator=g), torch.randn(4, heads[0], S, generator=g)

    out, lse = doc_packed_attn(q, k, v, cu, mask, scale, return_lse=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (4, heads[0], S)
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()
    got = grads(q, k, v)
    ref_out, ref_lse = oracle(q, k, v, cu, mask, scale)
    ((ref_out * w_out.double()).sum() + (ref_lse * w_lse.double()).sum()).backward()

    torch.testing.assert_close(out, ref_out.float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-5, rtol=2e-5)
    for name, mine, ref in zip("qkv", got, grads(q, k, v), strict=True):
        torch.testing.assert_close(mine, ref.float(), atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")


def test_out_only_gradient_and_int64_rows():
    q, k, v, cu = inputs()
    doc_packed_attn(q, k, v, cu.long(), Mask.sliding_window(3)).sum().backward()
    got = grads(q, k, v)
    oracle(q, k, v, cu, Mask.sliding_window(3))[0].sum().backward()
    for mine, ref in zip(got, grads(q, k, v), strict=True):
        torch.testing.assert_close(mine, ref.float(), atol=1e-4, rtol=1e-4)


# -- the custom-op contract --------------------------------------------------------------------
def test_opcheck():
    """Every opcheck test once per op; the variants (other mask and scale, no dlse) skip the slow
    aot_dispatch_dynamic compile."""
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    q, k, v, cu = inputs()
    causal, window, chunked = (m.spec() for m in (Mask.causal(), Mask.sliding_window(3, 1), Mask.chunked(4)))
    torch.library.opcheck(doc_packed_attn_op, (q, k, v, cu, causal, None))
    torch.library.opcheck(doc_packed_attn_op, (q, k, v, cu, window, 0.5), test_utils=quick)
    torch.library.opcheck(doc_packed_attn_op, (q, k, v, cu, chunked, None), test_utils=quick)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = doc_packed_attn_op(q, k, v, cu, causal, None)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(doc_packed_attn_backward_op, (dout, dlse, q, k, v, out, lse, cu, causal, None))
    torch.library.opcheck(doc_packed_attn_backward_op, (dout, None, q, k, v, out, lse, cu, window, 0.5),
                          test_utils=quick)


def test_compile_fullgraph_matches_eager():
    """No graph break, dynamic batch size, same gradients (aot_eager: inductor adds ~20 s of codegen)."""
    mask = Mask.sliding_window(3)

    def step(q, k, v, cu):
        out, lse = doc_packed_attn(q, k, v, cu, mask, return_lse=True)
        return out.square().sum() + lse.sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for b in (4, 2):
        q, k, v, cu = inputs(b=b)
        step(q, k, v, cu).backward()
        eager = grads(q, k, v)
        compiled(q, k, v, cu).backward()
        for mine, ref in zip(grads(q, k, v), eager, strict=True):
            torch.testing.assert_close(mine, ref)


def test_backward_uses_saved_out_and_lse(monkeypatch):
    calls = {"attend": 0, "attend_backward": 0}

    def counting(name):
        real = getattr(kernels, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    for name in calls:
        monkeypatch.setattr(kernels, name, counting(name))
    q, k, v, cu = inputs()
    with torch.profiler.profile() as prof:
        doc_packed_attn(q, k, v, cu).sum().backward()
    assert calls == {"attend": 1, "attend_backward": 1}
    names = [e.name for e in prof.events()]
    assert names.count("doccp::doc_packed_attn") == 1
    assert names.count("doccp::doc_packed_attn_backward") == 1


class _StubDeviceKernels:
    """The CUDA module's device entry points, emulated on CPU to check the sync-free plumbing."""

    @staticmethod
    def _slices(cu_q, cu_k, max_q, max_k, total):
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and max_q == max_k == S and int(cu_q[-1]) == total
        return kernels.doc_slices(cu_q.long())

    @classmethod
    def varlen_forward(cls, q, k, v, cu_q, cu_k, max_q, max_k, mask, scale):
        return kernels.attend(q, k, v, cls._slices(cu_q, cu_k, max_q, max_k, q.shape[0]), mask, scale)

    @classmethod
    def varlen_backward(cls, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, mask, scale):
        slices = cls._slices(cu_q, cu_k, max_q, max_k, q.shape[0])
        return kernels.attend_backward(dout, q, k, v, out, lse, slices, mask, scale)


def test_device_path_plumbing(monkeypatch):
    from doccp.interop import doc_packed

    q, k, v, cu = inputs()
    out, lse = doc_packed_attn(q, k, v, cu, Mask.sliding_window(2, 1), return_lse=True)
    (out.sum() + lse.sum()).backward()
    host = [out, lse, *grads(q, k, v)]
    monkeypatch.setattr(doc_packed, "_device_kernels", lambda q, mask: _StubDeviceKernels)
    out, lse = doc_packed_attn(q, k, v, cu, Mask.sliding_window(2, 1), return_lse=True)
    (out.sum() + lse.sum()).backward()
    for mine, ref in zip([out, lse, *grads(q, k, v)], host, strict=True):
        torch.testing.assert_close(mine, ref)


def _has_device_kernels() -> bool:
    from doccp.interop.doc_packed import _device_kernels

    return torch.cuda.is_available() and _device_kernels(torch.empty(0, device="cuda"), Mask.causal()) is not None


@pytest.mark.cuda
@pytest.mark.skipif(not _has_device_kernels(), reason="needs CUDA and doccp.kernels.cuda's varlen entry points")
def test_cuda_never_syncs_on_cu_rows():
    q, k, v, cu = inputs()
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    cu = cu.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = doc_packed_attn(q, k, v, cu, return_lse=True)
        (out.float().sum() + lse.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = oracle(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), Mask.causal())[0]
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=2e-2)


# -- bad input -----------------------------------------------------------------------------------
def _bad(change):
    q, k, v, cu = (t.detach() for t in inputs())
    args = {"q": q, "k": k, "v": v, "cu_rows": cu}
    args.update(change(q, k, v, cu))
    return args


@pytest.mark.parametrize("change, error, match", [
    (lambda q, k, v, cu: {"k": k[:, :-1], "v": v[:, :-1]}, ValueError, "same tokens"),
    (lambda q, k, v, cu: {"k": k[:, :-1]}, ValueError, "k and v must have the same shape"),
    (lambda q, k, v, cu: {"q": q[0]}, ValueError, r"\[B, S, heads, head_dim\]"),
    (lambda q, k, v, cu: {"q": q[:, :, :3]}, ValueError, "multiple of the number of KV heads"),
    (lambda q, k, v, cu: {"v": v.double()}, TypeError, "share one dtype"),
    (lambda q, k, v, cu: {"scale": float("nan")}, ValueError, "scale must be finite"),
    (lambda q, k, v, cu: {"cu_rows": cu.float()}, TypeError, "int32 or int64"),
    (lambda q, k, v, cu: {"cu_rows": cu[:2]}, ValueError, r"\[B=4, MAX_DOCS\+1"),
    (lambda q, k, v, cu: {"cu_rows": cu + 1}, ValueError, "start at 0"),
    (lambda q, k, v, cu: {"cu_rows": torch.where(cu == S, S - 1, cu)}, ValueError, "end at seq_len=12"),
    (lambda q, k, v, cu: {"cu_rows": torch.where(cu == 4, 0, cu)}, ValueError, "non-decreasing"),
    (lambda q, k, v, cu: {"mask": "causal"}, TypeError, "doccp.Mask"),
])
def test_bad_input_raises_clearly(change, error, match):
    with pytest.raises(error, match=match):
        doc_packed_attn(**_bad(change))


# -- DTensor: a real 2x2 ("dp", "tp") gloo mesh ---------------------------------------------------------
def _dtensor_cases(rank: int) -> list[dict]:
    """Each placement: forward + backward under CommDebugMode, compared with the plain op."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mask = Mask.sliding_window(4)
    R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)  # noqa: N806
    cases = {  # name: (q/k heads, placements of q/k/v/out/grads, of lse, of cu_rows, lse gets a gradient)
        "dp-batch,tp-heads": ((4, 2), (S0, S2), (S0, S1), (S0, R), True),
        "dp-batch,tp-heads,out-grad-only": ((4, 2), (S0, S2), (S0, S1), (S0, R), False),
        "replicate-all": ((4, 2), (R, R), (R, R), (R, R), True),
        "batch-both-dims": ((4, 2), (S0, S0), (S0, S0), (S0, S0), True),
        "heads-tp-only": ((4, 2), (R, S2), (R, S1), (R, R), True),
        # 3 kv heads cannot split over 2 ranks in whole GQA groups: the rule must refuse it
        "uneven-gqa-heads": ((6, 3), (S0, S2), (S0, S1), (S0, R), True),
    }
    results = []
    for name, ((hq, hkv), bshd, lse_p, rows_p, lse_grad) in cases.items():
        q, k, v, cu = inputs(hq, hkv, seed=3)  # the same on every rank
        g = torch.Generator().manual_seed(4)
        dout, dlse = torch.randn(4, S, hq, 8, generator=g), torch.randn(4, hq, S, generator=g)
        used = 2 if lse_grad else 1
        out, lse = doc_packed_attn(q, k, v, cu, mask, return_lse=True)
        torch.autograd.backward([out, lse][:used], [dout, dlse][:used])
        ref = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads(q, k, v), strict=True))}

        dq, dk, dv = (distribute_tensor(t.detach(), mesh, bshd).requires_grad_() for t in (q, k, v))
        dcu = distribute_tensor(cu, mesh, rows_p)
        g_out, g_lse = distribute_tensor(dout, mesh, bshd), distribute_tensor(dlse, mesh, lse_p)
        with CommDebugMode() as comm:
            d_out, d_lse = doc_packed_attn(dq, dk, dv, dcu, mask, return_lse=True)
            torch.autograd.backward([d_out, d_lse][:used], [g_out, g_lse][:used])
        got = {"out": d_out, "lse": d_lse, "dq": dq.grad, "dk": dk.grad, "dv": dv.grad}
        results.append({
            "case": name,
            "collectives": comm.get_total_counts(),
            "placements": {key: tuple(t.placements) for key, t in got.items()},
            "expected": {key: lse_p if key == "lse" else bshd for key in got},
            "max_err": max((t.full_tensor() - ref[key]).abs().max().item() for key, t in got.items()),
        })
    return results


def test_dtensor_2x2_mesh_shards_without_redistribution():
    for rank_results in spawn(_dtensor_cases, 4, threads=1):
        for r in rank_results:
            assert r["max_err"] < 1e-5, r
            if r["case"] == "uneven-gqa-heads":
                assert r["collectives"] > 0, r  # heads were gathered rather than mis-paired
            else:
                assert r["collectives"] == 0, r
                assert r["placements"] == r["expected"], r
