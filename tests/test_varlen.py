"""doccp.varlen_attention: the public single-device entry point (numerics are in test_kernels)."""

from __future__ import annotations

import pytest
import torch

import doccp
from doccp import DocLayout, Mask
from doccp.kernels import resolve_backend

LAYOUT = DocLayout.from_lengths([3, 0, 5])


def qkv(t=8, hq=4, hkv=2, d=16, dtype=torch.float32):
    return torch.randn(t, hq, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype)


def test_exported_lazily_and_runs():
    q, k, v = qkv()
    out = doccp.varlen_attention(q, k, v, LAYOUT)
    assert out.shape == q.shape and out.dtype == q.dtype
    out, lse = doccp.varlen_attention(q, k, v, LAYOUT, Mask.full(), scale=0.5, return_lse=True)
    assert lse.shape == (4, 8) and lse.dtype == torch.float32 and not lse.requires_grad


def test_documents_do_not_interact():
    """Changing one document's keys leaves the other documents' outputs untouched."""
    q, k, v = qkv()
    base = doccp.varlen_attention(q, k, v, LAYOUT, Mask.full())
    k2 = k.clone()
    k2[3:] += torch.randn_like(k2[3:])  # (a constant shift would not change the softmax)
    moved = doccp.varlen_attention(q, k2, v, LAYOUT, Mask.full())
    assert torch.equal(base[:3], moved[:3]) and not torch.allclose(base[3:], moved[3:])


def test_auto_backend():
    q, _, _ = qkv()
    assert resolve_backend("auto", q) == "cpu"
    assert resolve_backend("auto", q.double()) == "reference"


@pytest.mark.parametrize(("change", "error", "match"), [
    (lambda q, k, v, lay: (q[0], k, v, lay), ValueError, r"q must be 3-D \[T, heads, head_dim\]"),
    (lambda q, k, v, lay: (q.unsqueeze(0), k, v, lay), ValueError, "flatten"),
    (lambda q, k, v, lay: (q, k[:5], v[:5], lay), ValueError, "same tokens"),
    (lambda q, k, v, lay: (q, k, v[:, :1], lay), ValueError, "k and v must have the same shape"),
    (lambda q, k, v, lay: (q, k[..., :8], v[..., :8], lay), ValueError, "same head_dim"),
    (lambda q, k, v, lay: (q[:, :3], k, v, lay), ValueError, "multiple of the number of KV heads"),
    (lambda q, k, v, lay: (q, k.double(), v, lay), TypeError, "share one dtype"),
    (lambda q, k, v, lay: (q.int(), k, v, lay), TypeError, "q must be float32"),
    (lambda q, k, v, lay: (q, k, v, DocLayout.from_lengths([3, 4])), ValueError, "layout holds 7 tokens"),
    (lambda q, k, v, lay: (q, k, v, [3, 0, 5]), TypeError, "layout must be a doccp.DocLayout"),
    (lambda q, k, v, lay: (q.numpy(), k, v, lay), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v, lay: (q, k.to("meta"), v, lay), ValueError, "one device"),
], ids=["q 2-D", "q 4-D", "k tokens", "v heads", "head dim", "gqa ratio", "dtype mismatch", "int dtype",
        "layout length", "layout type", "not a tensor", "device"])
def test_bad_input(change, error, match):
    with pytest.raises(error, match=match):
        doccp.varlen_attention(*change(*qkv(), LAYOUT))


def test_bad_options():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="mask must be a doccp.Mask"):
        doccp.varlen_attention(q, k, v, LAYOUT, mask="causal")
    with pytest.raises(TypeError, match="scale must be a real number"):
        doccp.varlen_attention(q, k, v, LAYOUT, scale="0.5")
    with pytest.raises(ValueError, match="backend must be"):
        doccp.varlen_attention(q, k, v, LAYOUT, backend="triton")
    with pytest.raises(ValueError, match="must be >= 0"):
        doccp.varlen_attention(q, k, v, LAYOUT, Mask.sliding_window(-1))
    with pytest.raises(ValueError, match="the cpu backend needs CPU tensors"):
        doccp.varlen_attention(*(x.to("meta") for x in (q, k, v)), LAYOUT, backend="cpu")


def test_empty_stream():
    q, k, v = qkv(t=0)
    out = doccp.varlen_attention(q.requires_grad_(), k, v, DocLayout.from_lengths([0, 0]))
    out.sum().backward()
    assert out.shape == (0, 4, 16) and q.grad.shape == q.shape
