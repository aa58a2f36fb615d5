"""Drop-in modules: document-aware attention with RoPE, and a tiny LLaMA-style model.

Inputs are packed token streams ``[T, dim]``: on one device the whole stream with its
:class:`~doccp.DocLayout`; under CP the rank's shard (``doccp.shard(x, plan, rank)``) with
the :class:`~doccp.Plan` and process group. The modules only differ from their usual
LLaMA counterparts in two places, both driven by the layout or plan:

- RoPE positions restart at every document (``layout.positions()`` / ``plan.positions(rank)``),
  so a token's rotation does not depend on how documents were packed or sharded;
- attention never crosses a document (``doccp.varlen_attention`` / ``doccp.attention``).

The parameters do not depend on the layout or the world size, so the same weights give
the same loss and gradients on one device and under CP.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from doccp import comm
from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan import Plan

#: ``attend(q, k, v) -> out``: a replacement for one layer's attention call.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["apply_rope", "doc_positions", "DocAttention", "SwiGLU", "Block", "TinyLM"]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (LLaMA's rotate-half form) of ``x [..., H, D]`` at ``positions [...]``.

    Computed in fp32 (fp64 for fp64 input) and returned in ``x``'s dtype; ``D`` must be even.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {d}")
    if tuple(positions.shape) != tuple(x.shape[:-2]):
        raise ValueError(f"positions must have shape {tuple(x.shape[:-2])} (x without its [H, D] dims), "
                         f"got {tuple(positions.shape)}")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=compute, device=x.device) / d)
    angles = (positions.to(x.device, compute)[..., None] * inv_freq).unsqueeze(-2)  # [..., 1, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.to(compute).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def doc_positions(layout: DocLayout | None = None, plan: Plan | None = None,
                  group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Document-relative position of every token this process holds (int64, CPU)."""
    _check_context(layout, plan)
    return layout.positions() if plan is None else plan.positions(comm.rank(group))  # type: ignore[union-attr]


def _check_context(layout: DocLayout | None, plan: Plan | None) -> None:
    if (layout is None) == (plan is None):
        raise ValueError("pass exactly one of layout= (one device, the full stream) or plan= (CP, this rank's "
                         "shard, with group=)")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a doccp.Plan, got {type(plan).__name__}")
    if layout is not None and not isinstance(layout, DocLayout):
        raise TypeError(f"layout must be a doccp.DocLayout, got {type(layout).__name__}")


class DocAttention(nn.Module):
    """Multi-head (GQA) self-attention over packed documents: q/k/v/o projections, RoPE at
    document positions, attention within documents.

    ``forward(x, layout=...)`` on one device (``x`` is the whole stream ``[T, dim]``) or
    ``forward(x, plan=..., group=...)`` under CP (``x`` is this rank's shard; the plan's
    mask must be this module's mask).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, mask: Mask | None = None,
                 rope: bool = True, rope_base: float = 10000.0, bias: bool = False):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if dim % n_heads:
            raise ValueError(f"dim={dim} must be divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.mask = Mask.causal() if mask is None else mask
        self.rope, self.rope_base = rope, rope_base
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, layout: DocLayout | None = None, plan: Plan | None = None,
                group: dist.ProcessGroup | None = None, positions: torch.Tensor | None = None,
                algorithm: str = "auto", attend: Attend | None = None) -> torch.Tensor:
        """``x [T, dim] -> [T, dim]``. ``positions`` (from :func:`doc_positions`) may be passed
        to skip recomputing them in every layer; ``algorithm`` picks the CP algorithm
        (see :func:`doccp.attention`). ``attend(q, k, v)``, with ``positions``, replaces the
        attention call: how cache-backed inference (``doccp.prefill``/``decode``) plugs in."""
        if attend is not None:
            if positions is None:
                raise ValueError("attend= needs positions= (the document positions of x's tokens)")
        else:
            _check_context(layout, plan)
        if plan is not None and plan.mask != self.mask:
            raise ValueError(f"the plan's mask is {plan.mask} but this DocAttention uses {self.mask}; "
                             "build the plan with the module's mask")
        t = x.shape[0]
        q = self.wq(x).view(t, self.n_heads, self.head_dim)
        k = self.wk(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)
        if self.rope:
            pos = doc_positions(layout, plan, group).to(x.device) if positions is None else positions
            q, k = apply_rope(q, pos, self.rope_base), apply_rope(k, pos, self.rope_base)
        if attend is not None:
            out = attend(q, k, v)
        elif plan is None:
            from doccp.varlen import varlen_attention

            out = varlen_attention(q, k, v, layout, mask=self.mask)
        else:
            from doccp.algorithms import attention

            out = attention(q, k, v, plan, group=group, algorithm=algorithm)
        return self.wo(out.reshape(t, -1))


class SwiGLU(nn.Module):
    """LLaMA's gated MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, mask: Mask | None = None,
                 hidden: int | None = None, rope_base: float = 10000.0):
        super().__init__()
        hidden = hidden or 8 * ((8 * dim // 3 + 7) // 8)
        self.attn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.attn = DocAttention(dim, n_heads, n_kv_heads, mask, rope_base=rope_base)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor, layout: DocLayout | None = None, plan: Plan | None = None,
                group: dist.ProcessGroup | None = None, positions: torch.Tensor | None = None,
                algorithm: str = "auto", attend: Attend | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), layout, plan, group, positions, algorithm, attend)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """A small LLaMA-style language model over packed documents (examples, demo, tests).

    ``forward(tokens [T], layout=...)`` or ``forward(local_tokens, plan=..., group=...)``
    returns logits ``[T, vocab]`` for the tokens given (the local ones under CP).
    """

    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int | None = None,
                 mask: Mask | None = None, rope_base: float = 10000.0):
        super().__init__()
        self.mask = Mask.causal() if mask is None else mask
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, n_kv_heads, self.mask, rope_base=rope_base)
                                    for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, layout: DocLayout | None = None, plan: Plan | None = None,
                group: dist.ProcessGroup | None = None, algorithm: str = "auto", *,
                positions: torch.Tensor | None = None,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Logits ``[T, vocab]``. With ``attend(layer, q, k, v)`` and ``positions`` every layer's
        attention is that call instead (e.g. ``doccp.prefill`` into per-layer caches)."""
        if positions is None:
            positions = doc_positions(layout, plan, group)  # once, not per layer
        positions = positions.to(tokens.device)
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            layer_attend = None if attend is None else functools.partial(attend, i)
            x = block(x, layout, plan, group, positions, algorithm, layer_attend)
        return self.head(self.norm(x))
