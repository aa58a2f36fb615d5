"""The float64 oracle: dense [T, T] masked softmax over the whole packed stream.

Deliberately independent of doccp's kernels: it builds the document mask from doc ids and
positions and lets autograd produce the gradients.
"""

from __future__ import annotations

import math

import torch

from doccp import DocLayout, Mask
from doccp.masks import BandMask, ChunkedMask


def visible(mask: Mask, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Whether query position ``i`` sees key position ``j`` of the same document, from each mask
    kind's definition (written here again, independently of doccp's own code)."""
    if isinstance(mask, ChunkedMask):
        return (j <= i) & (i // mask.size == j // mask.size)
    assert isinstance(mask, BandMask), mask
    ok = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool)
    if mask.left is not None:
        ok &= j >= i - mask.left
    if mask.right is not None:
        ok &= j <= i + mask.right
    return ok


def dense_mask(layout: DocLayout, mask: Mask) -> torch.Tensor:
    doc, pos = layout.doc_ids(), layout.positions()
    return (doc[:, None] == doc[None, :]) & visible(mask, pos[:, None], pos[None, :])


def dense_attention(q, k, v, layout: DocLayout, mask: Mask, scale: float | None = None):
    """out [T, Hq, D], lse [Hq, T] in float64; rows with no visible key give 0 / -inf."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("thd,shd->hts", q, k) * scale
    s = s.masked_fill(~dense_mask(layout, mask), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("hts,shd->thd", p, v), lse


def random_lengths(rng, num_docs: int, max_len: int) -> list[int]:
    """Lengths with the awkward cases mixed in: zero-length and 1-token documents."""
    lengths = [rng.randint(0, max_len) for _ in range(num_docs)]
    for i in range(0, num_docs, 4):
        lengths[i] = [0, 1, 2][i // 4 % 3]
    return lengths


def expect_errors(calls: dict, rank: int) -> list[str]:
    """Run every bad call; each must raise ValueError/TypeError (on every rank: the callers
    run this inside spawned groups). Returns ``"name: message"`` per call, in order."""
    messages = []
    for name, call in calls.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            messages.append(f"{name}: {e}")
        else:
            raise AssertionError(f"{name}: no error on rank {rank}")
    return messages


def assert_rank_matches(got: dict, ref_out, ref_lse, ref_grads, idx, what: str) -> None:
    """One rank's ``out``, ``lse`` and ``dq/dk/dv`` (fp32 CP results) against the float64 oracle's
    rows ``idx`` of that rank: out/lse within 2e-5, gradients within 1e-4, ``-inf`` lse exactly
    where the oracle has it."""
    torch.testing.assert_close(got["out"].double(), ref_out[idx].detach(), atol=2e-5, rtol=0, msg=what)
    finite = torch.isfinite(ref_lse[:, idx])
    assert torch.equal(torch.isfinite(got["lse"]), finite), what
    torch.testing.assert_close(got["lse"].double()[finite], ref_lse[:, idx][finite], atol=2e-5, rtol=0)
    for name, ref in zip(("dq", "dk", "dv"), ref_grads, strict=True):
        torch.testing.assert_close(got[name].double(), ref[idx], atol=1e-4, rtol=0, msg=f"{what} {name}")
