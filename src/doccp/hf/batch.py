"""One packed batch, as transformers' ``DataCollatorWithFlattening`` makes it, cut for one CP rank.

A flattened batch is one stream ``input_ids [1, T]`` whose ``position_ids`` restart at every
document (or whose ``cu_seq_lens_q`` says where documents start). :func:`shard_batch` reads
the documents from it, plans the split over the CP group and returns what this rank passes as
``model(**local)``::

    full stream    | doc0 |d1|      doc2      |d3|          labels shifted on the full stream,
    rank 0 gets    | doc0 |   head of doc2 ... |            then sharded: a shard's last token's
    rank 1 gets         |d1|  ... tail of doc2 |d3|         target usually lives on another rank

Next to the rank's tokens it carries a :class:`BatchPlan` (keyword ``doccp_plan``) that
transformers hands, untouched, to every attention layer: that is how the layers know the
documents, the plan and the process group. HF's own label shift would be wrong on a shard, so
the labels come pre-shifted (``shift_labels``) with the batch's *global* target count
(``num_items_in_batch``): each rank's loss is its part of one sum, and the ranks' losses add up
to the one-process mean loss.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from doccp import comm
from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan import Plan, plan

#: The keyword that carries the :class:`BatchPlan` through ``model(**local)`` to the attention layers.
PLAN_KWARG = "doccp_plan"

#: Keys that describe the full stream's documents; the plan replaces them on a shard.
_LAYOUT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(eq=False)
class BatchPlan:
    """The batch's plan and CP group, as the attention layers receive them.

    One plan decides which tokens each rank holds; every layer may apply its own mask (hybrid
    models mix sliding-window and full layers). :meth:`for_mask` gives the plan for a layer's
    mask (:meth:`doccp.Plan.with_mask`: the batch's pieces, built once per mask, so its cached
    schedules serve every layer with that mask).
    """

    plan: Plan
    group: dist.ProcessGroup | None = None

    def for_mask(self, mask: Mask) -> Plan:
        return self.plan.with_mask(mask)


class ShardedBatch(dict):
    """``model(**local)`` keywords for one rank, with the batch's :class:`~doccp.Plan` as ``.plan``
    (``doccp.unshard(out.logits[0], local.plan, group)`` gives the full stream's logits)."""

    plan: Plan
    group: dist.ProcessGroup | None


def shard_batch(batch: Mapping[str, Any], group: dist.ProcessGroup | None = None, strategy: str = "balanced",
                mask: Mask | None = None, num_items_in_batch: int | torch.Tensor | None = None,
                ignore_index: int = -100) -> ShardedBatch:
    """This rank's part of a packed batch, ready for ``model(**local)`` with doccp attention.

    Args:
        batch: a padding-free batch (``DataCollatorWithFlattening``): ``input_ids [1, T]``,
            ``position_ids [1, T]`` restarting per document and/or ``cu_seq_lens_q``, optional
            ``labels [1, T]`` (or ``shift_labels``). Every rank of ``group`` must pass the same batch
            (checked). Other ``[1, T]`` tensors are sharded like ``input_ids``; other values pass
            through unchanged. A 2-D ``attention_mask`` is accepted only without padding.
        group: the CP process group (``None``: the default group; one process without
            ``torch.distributed``).
        strategy: the planner's strategy (see :func:`doccp.plan`).
        mask: the mask whose work the planner balances (default causal; the model's window for a
            sliding-window model). Each layer still applies its own mask.
        num_items_in_batch: the loss normaliser; default: the number of targets of this batch.
            Pass a larger count to normalise over several batches (gradient accumulation, data
            parallelism).
        ignore_index: the label that marks "no target" (transformers: -100).

    Returns:
        a :class:`ShardedBatch`: the rank's ``input_ids``, ``position_ids`` (document positions,
        for RoPE), ``labels`` and ``shift_labels`` (targets shifted on the full stream, never
        across documents), ``num_items_in_batch``, ``use_cache=False`` and ``doccp_plan``.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of model inputs (a DataCollatorWithFlattening batch), "
                        f"got {type(batch).__name__}")
    if "input_ids" not in batch:
        raise ValueError(f"batch needs 'input_ids' ([1, T], a flattened batch), got keys {sorted(batch)}")
    input_ids = _stream(batch["input_ids"], "input_ids")
    device, num_tokens = input_ids.device, input_ids.shape[1]
    layout = _layout(batch, num_tokens)
    world, rank = comm.size(group), comm.rank(group)
    labels = _shift_labels(batch, layout, num_tokens, ignore_index)
    _check_same_batch([input_ids, layout.cu_seqlens, labels], group)

    the_plan = plan(layout, world, Mask.causal() if mask is None else mask, strategy)
    index = the_plan.indices(rank).to(device)
    out = ShardedBatch()
    for key, value in batch.items():
        if key in _LAYOUT_KEYS or key in ("labels", "shift_labels", "attention_mask"):
            continue
        out[key] = value.index_select(1, index.to(value.device)) if _is_per_token(value, num_tokens) else value
    if "position_ids" not in batch:
        out["position_ids"] = the_plan.positions(rank).to(device).unsqueeze(0)
    if labels is not None:
        local = labels.index_select(1, index.to(labels.device))
        out["labels"] = out["shift_labels"] = local  # `labels` switches the model's loss on; it reads shift_labels
        out["num_items_in_batch"] = (int((labels != ignore_index).sum()) if num_items_in_batch is None
                                     else num_items_in_batch)
    out["use_cache"] = False  # a cache turns transformers' packed-sequence handling off (and CP has none)
    out[PLAN_KWARG] = BatchPlan(the_plan, group)
    out.plan, out.group = the_plan, group
    return out


def _stream(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ([1, T]), got {type(value).__name__}")
    if value.dim() != 2 or value.shape[0] != 1:
        raise ValueError(f"{name} must be one packed stream [1, T], got shape {tuple(value.shape)}; pack the "
                         "batch with transformers.DataCollatorWithFlattening (padding-free)")
    return value


def _layout(batch: Mapping[str, Any], num_tokens: int) -> DocLayout:
    """Documents from ``cu_seq_lens_q`` and/or ``position_ids`` (which must then agree)."""
    layout = None
    if "cu_seq_lens_q" in batch:
        layout = DocLayout.from_cu_seqlens(batch["cu_seq_lens_q"])
        if layout.num_tokens != num_tokens:
            raise ValueError(f"cu_seq_lens_q ends at {layout.num_tokens} but input_ids holds {num_tokens} tokens")
    if "position_ids" in batch:
        positions = _stream(batch["position_ids"], "position_ids")
        if positions.shape[1] != num_tokens:
            raise ValueError(f"position_ids has {positions.shape[1]} tokens but input_ids has {num_tokens}")
        from_positions = DocLayout.from_position_ids(positions)
        if layout is not None and not torch.equal(torch.unique(layout.cu_seqlens), from_positions.cu_seqlens):
            raise ValueError("cu_seq_lens_q and position_ids disagree on where documents start; position_ids must "
                             "restart at every boundary of cu_seq_lens_q")
        layout = layout or from_positions
    if layout is None:
        raise ValueError("batch needs 'position_ids' (restarting at every document) or 'cu_seq_lens_q' to tell the "
                         "documents apart: DataCollatorWithFlattening returns position_ids by default")
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise ValueError("attention_mask marks padding tokens, which doccp does not support: pack the batch "
                         "padding-free with transformers.DataCollatorWithFlattening")
    return layout


def _shift_labels(batch: Mapping[str, Any], layout: DocLayout, num_tokens: int,
                  ignore_index: int) -> torch.Tensor | None:
    """Next-token targets of the full stream ``[1, T]``: HF shifts labels inside the model, which on
    a shard would pair a token with the wrong neighbour; here they never cross a document."""
    if "shift_labels" in batch:
        shifted = _stream(batch["shift_labels"], "shift_labels")
    elif "labels" in batch:
        labels = _stream(batch["labels"], "labels")
        shifted = layout.next_token_targets(labels[0], ignore_index).unsqueeze(0) if num_tokens else labels
    else:
        return None
    if shifted.shape[1] != num_tokens:
        raise ValueError(f"labels have {shifted.shape[1]} tokens but input_ids has {num_tokens}")
    return shifted


def _is_per_token(value: Any, num_tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == num_tokens


def _check_same_batch(tensors: list[torch.Tensor | None], group: dist.ProcessGroup | None) -> None:
    """Every rank of the CP group must shard the same batch (else each plans another stream and
    the attention would mix them): compare a digest of it, one small collective per batch."""
    if comm.size(group) == 1:
        return
    digest = hashlib.blake2b(digest_size=16)
    for t in tensors:
        if t is not None:
            digest.update(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    found: list[Any] = [None] * comm.size(group)
    dist.all_gather_object(found, digest.hexdigest(), group=group)
    if len(set(found)) > 1:
        differ = [r for r, d in enumerate(found) if d != found[0]]
        raise ValueError(f"the ranks of the CP group passed different batches to shard_batch (ranks {differ} differ "
                         "from rank 0); every CP rank must pass the same full batch (doccp.hf.CPTrainer pools them)")
