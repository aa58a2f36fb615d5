"""doccp as a transformers attention implementation (``attn_implementation="doccp"``).

transformers calls ``fn(module, query [B, H, T, D], key, value, attention_mask, dropout=...,
scaling=..., sliding_window=..., softcap=..., **kwargs)`` in every attention layer, where
``kwargs`` are the keywords given to ``model(...)``; it expects ``([B, T, H, D], weights)``
back. This function turns the layer's tensors into doccp's THD layout and:

- with a :class:`~doccp.hf.batch.BatchPlan` in ``kwargs`` (``shard_batch`` puts it there): exact
  CP attention over the plan's group, with the layer's own mask on the batch's plan;
- without one, on one process: exact attention within the documents that ``position_ids``
  delimit (they restart at every document), like transformers' packed-sequence masks;
- without one, while ``torch.distributed`` has more than one rank: an error. A CP rank given an
  unsharded batch would attend to its own tokens only, silently wrong; a data-parallel-only job
  (whole batches per rank) says so with ``register(allow_local=True)``.

The mask function registered next to it returns no mask (documents come from the plan or the
positions, so transformers builds no ``[T, T]`` mask) and refuses padding masks.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist

from doccp.hf.batch import PLAN_KWARG, BatchPlan
from doccp.layout import DocLayout
from doccp.masks import Mask

#: Keywords naming features doccp cannot honour (transformers passes them when a layer uses them).
_UNSUPPORTED = {
    "softcap": "attention logit softcapping",
    "s_aux": "attention sinks",
    "position_bias": "an additive position bias",
    "cache": "a paged KV cache",
}


def register(name: str = "doccp", *, allow_local: bool = False) -> str:
    """Register doccp with transformers as attention implementation ``name`` and return ``name``.

    Then build models with ``attn_implementation=name`` (or ``model.set_attn_implementation(name)``).
    ``allow_local=True`` lets calls without a ``shard_batch`` plan attend locally even while
    ``torch.distributed`` has several ranks: for data-parallel-only jobs, whose ranks each hold
    whole batches. Registering a name again replaces its settings.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("doccp.hf needs transformers: pip install 'doccp[hf]'") from e
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    AttentionInterface.register(name, functools.partial(attention_forward, allow_local=allow_local))
    AttentionMaskInterface.register(name, no_mask)
    return name


def layer_mask(module: torch.nn.Module, sliding_window: int | None = None, is_causal: bool | None = None) -> Mask:
    """The doccp :class:`~doccp.Mask` of one transformers attention layer.

    transformers' window ``W`` lets a query see ``W`` keys including itself
    (``kv > q - W``), which is doccp's ``sliding_window(W - 1)``. A ``"chunked_attention"`` layer
    (Llama 4) is ``Mask.chunked(config.attention_chunk_size)``: chunks start at every document's
    first token (transformers' own masks chunk a packed stream by its absolute index instead).
    """
    config = getattr(module, "config", None)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(causal) and getattr(config, "is_causal", True) is not False
    layer_types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if causal and layer_types and layer is not None and layer_types[layer] == "chunked_attention":
        return Mask.chunked(config.attention_chunk_size)  # each document chunked from its own start
    if sliding_window is None:
        return Mask.causal() if causal else Mask.full()
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int (keys a query sees, itself included), "
                         f"got {sliding_window!r}")
    if not causal:
        raise ValueError("doccp attention supports bidirectional layers without a window only (transformers' "
                         "bidirectional windows differ by model); use attn_implementation='sdpa' for this model")
    return Mask.sliding_window(sliding_window - 1)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, is_causal: bool | None = None, *,
                      allow_local: bool = False, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls (see the module docstring)."""
    layer = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    for kwarg, what in _UNSUPPORTED.items():
        if kwargs.get(kwarg) is not None:
            raise ValueError(f"{layer} uses {what} ({kwarg}=...), which doccp attention does not support; "
                             "use another attn_implementation for this model")
    if dropout:
        raise ValueError(f"{layer} asks for attention dropout {dropout}, which doccp attention does not support; "
                         "set the config's attention_dropout=0.0")
    if attention_mask is not None:
        raise ValueError(f"{layer} received an attention mask; doccp attention takes documents from position_ids "
                         "or shard_batch's plan and builds no mask: pass no attention_mask (a 4-D mask is not "
                         "supported)")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"doccp attention takes one packed stream (batch size 1), got query of shape "
                         f"{tuple(query.shape)}; pack the batch with transformers.DataCollatorWithFlattening")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"doccp attention got {query.shape[2]} queries but {key.shape[2]} keys: a KV cache "
                         "(generation) is not supported; train with use_cache=False, and generate with sdpa")
    mask = layer_mask(module, sliding_window, is_causal)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, head_dim]
    carried = kwargs.get(PLAN_KWARG)
    if carried is not None:
        if not isinstance(carried, BatchPlan):
            raise TypeError(f"{PLAN_KWARG} must be the BatchPlan that doccp.hf.shard_batch puts in the batch, got "
                            f"{type(carried).__name__}")
        from doccp.algorithms import attention

        out = attention(q, k, v, carried.for_mask(mask), group=carried.group, scale=scaling)
    else:
        out = _local(q, k, v, mask, scaling, kwargs.get("position_ids"), layer, allow_local)
    return out.unsqueeze(0), None


def _local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scaling: float | None,
           position_ids: torch.Tensor | None, layer: str, allow_local: bool) -> torch.Tensor:
    """One process, the whole batch: documents from position_ids."""
    if not allow_local and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{layer}: doccp attention got a batch without a doccp plan while torch.distributed has "
                         f"{dist.get_world_size()} ranks, so it cannot tell a context-parallel rank (which must "
                         "attend across ranks) from a data-parallel one; pass model(**doccp.hf.shard_batch(batch, "
                         "group=cp_group)), or register(allow_local=True) if no rank shares a batch (data "
                         "parallelism only)")
    if position_ids is None:
        raise ValueError(f"{layer}: doccp attention needs position_ids (restarting at every document) to find the "
                         "documents, and this model passed none to its attention layers; use shard_batch")
    if position_ids.shape[-1] != q.shape[0]:
        raise ValueError(f"{layer}: position_ids hold {position_ids.shape[-1]} tokens but the layer has "
                         f"{q.shape[0]}")
    from doccp.varlen import varlen_attention

    return varlen_attention(q, k, v, _layout_of(position_ids), mask, scale=scaling)


_last_layout: tuple[weakref.ref, int, DocLayout] | None = None


def _layout_of(position_ids: torch.Tensor) -> DocLayout:
    """The documents of ``position_ids``, read once per forward: every layer gets the same tensor,
    and reading it copies it to the host (a device sync on GPUs)."""
    global _last_layout
    if _last_layout is not None:
        ref, version, layout = _last_layout
        if ref() is position_ids and version == position_ids._version:
            return layout
    layout = DocLayout.from_position_ids(position_ids.reshape(1, -1))
    _last_layout = (weakref.ref(position_ids), position_ids._version, layout)
    return layout


def no_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
            mask_function: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """transformers' mask hook: doccp needs no mask (so none is built), and cannot honour padding."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("attention_mask marks padding tokens, which doccp attention does not support: pack the "
                         "batch padding-free with transformers.DataCollatorWithFlattening")
    return None
