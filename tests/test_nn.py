"""doccp.nn: RoPE, DocAttention, and a tiny LLaMA-style model that trains the same under CP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import doccp
from doccp.launch import WorkerError, spawn
from doccp.nn import DocAttention, TinyLM, apply_rope, doc_positions


def test_rope_depends_only_on_relative_position():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 3, 16, generator=gen, dtype=torch.float64).unbind(0)

    def score(i, j):
        qi = apply_rope(q, torch.tensor([i]))
        kj = apply_rope(k, torch.tensor([j]))
        return (qi * kj).sum(-1)

    torch.testing.assert_close(score(5, 2), score(105, 102))
    torch.testing.assert_close(score(0, 7), score(40, 47))
    assert not torch.allclose(score(5, 2), score(5, 3))
    torch.testing.assert_close(apply_rope(q, torch.tensor([0])), q)  # position 0 is the identity
    rotated = apply_rope(q, torch.tensor([1234]))
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))  # a rotation
    half = apply_rope(q.float().half(), torch.tensor([3]))
    assert half.dtype == torch.float16


def test_rope_bad_input():
    with pytest.raises(ValueError, match="even head dimension"):
        apply_rope(torch.randn(4, 2, 5), torch.arange(4))
    with pytest.raises(ValueError, match=r"positions must have shape \(4,\)"):
        apply_rope(torch.randn(4, 2, 6), torch.arange(3))


def test_doc_attention_is_packing_invariant():
    """A document's output does not depend on what it is packed with: RoPE positions and
    the attention both restart at document boundaries."""
    torch.manual_seed(0)
    attn = DocAttention(32, 4, 2).double()
    lens = [7, 12, 5]
    x = torch.randn(sum(lens), 32, dtype=torch.float64)
    packed = attn(x, layout=doccp.DocLayout.from_lengths(lens))
    alone = [attn(part, layout=doccp.DocLayout.from_lengths([len(part)])) for part in x.split(lens)]
    torch.testing.assert_close(packed, torch.cat(alone))


def test_doc_attention_bad_input():
    attn = DocAttention(16, 4, 2)
    x = torch.randn(10, 16)
    layout = doccp.DocLayout.from_lengths([4, 6])
    plan = doccp.plan(layout, 1, doccp.Mask.full())
    with pytest.raises(ValueError, match="exactly one of layout"):
        attn(x)
    with pytest.raises(ValueError, match="exactly one of layout"):
        attn(x, layout=layout, plan=plan)
    with pytest.raises(TypeError, match="plan must be a doccp.Plan"):
        attn(x, plan=layout)
    with pytest.raises(ValueError, match="the plan's mask is full but this DocAttention uses causal"):
        attn(x, plan=plan)
    with pytest.raises(ValueError, match="divisible by n_heads"):
        DocAttention(10, 4)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        DocAttention(16, 4, 3)
    assert doc_positions(layout).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]


# -- CP = one process, at 2 and 3 gloo ranks (one spawned job per world size) -----------------

MODEL = {"vocab": 61, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
CP_CASES = [  # (doc lengths, mask, strategy, algorithm)
    ([37, 1, 64, 9, 3, 50], doccp.Mask.causal(), "balanced", "auto"),
    ([80, 2, 45], doccp.Mask.causal(), "head_tail", "ring_kv"),
    ([30, 70, 11], doccp.Mask.sliding_window(8), "contiguous", "allgather"),
]


def loss_and_grads(model, tokens, targets, n_targets, **where):
    logits = model(tokens, **where)
    loss = F.cross_entropy(logits, targets, reduction="sum", ignore_index=-100) / n_targets
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def _cp_equals_one_process(rank: int, n: int) -> int:
    for lens, mask, strategy, algorithm in CP_CASES:
        layout = doccp.DocLayout.from_lengths(lens)
        tokens = torch.randint(MODEL["vocab"], (layout.num_tokens,), generator=torch.Generator().manual_seed(3))
        targets = layout.next_token_targets(tokens)
        n_targets = int((targets != -100).sum())
        torch.manual_seed(0)
        model = TinyLM(**MODEL, mask=mask)

        ref_loss, ref_grads = loss_and_grads(model, tokens, targets, n_targets, layout=layout)

        plan = doccp.plan(layout, n, mask, strategy)
        local = (doccp.shard(t, plan, rank) for t in (tokens, targets))
        loss, grads = loss_and_grads(model, *local, n_targets, plan=plan, algorithm=algorithm)
        dist.all_reduce(loss)  # each rank's loss is its tokens' share of the mean
        for g in grads:
            dist.all_reduce(g)
        assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss)), f"loss {loss} vs {ref_loss}"
        for (name, _), g, ref in zip(model.named_parameters(), grads, ref_grads, strict=True):
            err = float((g - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
            assert err < 1e-4, f"{name}: max error {err:.1e} of the largest gradient ({strategy}, {algorithm})"
    return len(CP_CASES)


@pytest.mark.parametrize("n", [2, 3])
def test_tiny_lm_cp_matches_one_process(n):
    try:
        results = spawn(_cp_equals_one_process, n, n, threads=1)
    except WorkerError as e:
        pytest.fail(str(e))
    assert results == [len(CP_CASES)] * n
