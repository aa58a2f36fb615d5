"""``transformers.Trainer`` with doccp context parallelism: :class:`CPTrainer`.

The world's ranks form CP groups of ``cp_size`` consecutive ranks; the groups are the
data-parallel replicas. Each rank loads its own micro-batch as usual (the Trainer's data
loader shards over all ranks), and the ranks of a CP group pool theirs into one packed
stream that the plan splits over them::

    ranks           0     1   |   2     3          cp_size=2: CP groups {0, 1} and {2, 3}
    loads           b0    b1  |   b2    b3         per_device_train_batch_size samples each
    the group's     b0 + b1   |   b2 + b3          one packed stream per group, split by the plan
    batch

So a CP group trains on ``cp_size x per_device_train_batch_size`` samples, and the whole job on
``world_size x per_device_train_batch_size`` per step, as without CP: only the attention is split.
The Trainer's own machinery then does the rest: it counts the targets of all ranks
(``average_tokens_across_devices``), each rank's loss is its part of the sum over that count
times the world size, and DDP's average over the world gives the gradient of the mean loss
(CP parts summed, data-parallel replicas averaged by token count), the logged loss too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import transformers

from doccp import comm
from doccp.hf.attention import attention_forward
from doccp.hf.batch import shard_batch
from doccp.masks import Mask

#: Keys that describe a micro-batch's documents by offsets rather than per token.
_CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
_MAX_KEYS = ("max_length_q", "max_length_k")


class CPTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose model attends across the ranks of each CP group.

    Args (besides the Trainer's):
        cp_size: ranks per CP group (default: all ranks, one group; no data parallelism). Must
            divide the world size; groups are blocks of consecutive ranks.
        strategy, mask: passed to :func:`doccp.hf.shard_batch` for the planner.

    The model must use a doccp attention implementation (:func:`doccp.hf.register`) and the
    data collator must produce padding-free batches (``DataCollatorWithFlattening``). Run it
    under a launcher (``torchrun`` / ``accelerate launch``) so that accelerate sees the world;
    a process group set up otherwise needs ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in the
    environment before the Trainer is built (and ``use_cpu=True`` on CPU).
    """

    def __init__(self, *args: Any, cp_size: int | None = None, strategy: str = "balanced",
                 mask: Mask | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cp_strategy, self.cp_mask = strategy, mask
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.accelerator.num_processes != world:
            raise ValueError(f"torch.distributed has {world} ranks but accelerate sees "
                             f"{self.accelerator.num_processes}: launch with torchrun / accelerate launch, or set "
                             "RANK, WORLD_SIZE and LOCAL_RANK (and use_cpu=True on CPU) before building the Trainer")
        cp_size = world if cp_size is None else cp_size
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1 or world % cp_size:
            raise ValueError(f"cp_size must be a positive int dividing the world size {world}, got {cp_size!r}")
        self.cp_size = cp_size
        self.cp_group = _cp_group(cp_size, world)
        self._check_setup()

    def _check_setup(self) -> None:
        attn = getattr(self.model.config, "_attn_implementation", None)
        from transformers import AttentionInterface

        fn = AttentionInterface._global_mapping.get(attn)
        if getattr(fn, "func", fn) is not attention_forward:
            raise ValueError(f"the model's attn_implementation is {attn!r}; CPTrainer needs a doccp one: "
                             "doccp.hf.register() and attn_implementation='doccp'")
        if self.label_smoother is not None or self.compute_loss_func is not None:
            raise ValueError("CPTrainer computes the loss inside the model (on shifted, sharded labels): "
                             "label_smoothing_factor and compute_loss_func are not supported")
        if not self.model_accepts_loss_kwargs:
            raise ValueError("CPTrainer needs a model whose forward takes **kwargs (num_items_in_batch, the plan), "
                             "as transformers' causal LMs do")
        if not self.args.average_tokens_across_devices and self.args.world_size > 1:
            raise ValueError("CPTrainer needs average_tokens_across_devices=True: the ranks of a CP group share one "
                             "batch, so the loss is normalised by the target count of all ranks")

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        pooled = pool_batches(inputs, self.cp_group)
        local = shard_batch(pooled, self.cp_group, self.cp_strategy, self.cp_mask,
                            num_items_in_batch=num_items_in_batch)
        return super().compute_loss(model, dict(local), return_outputs, num_items_in_batch)

    def prediction_step(self, *args: Any, **kwargs: Any):
        if self.cp_size > 1:
            raise ValueError("CPTrainer does not evaluate under CP (cp_size > 1): the logits are sharded over the CP "
                             "group; evaluate with a plain transformers.Trainer on one process per replica")
        return super().prediction_step(*args, **kwargs)


def _cp_group(cp_size: int, world: int) -> dist.ProcessGroup | None:
    """This rank's CP group: blocks of ``cp_size`` consecutive ranks (every rank creates every
    group, as ``new_group`` requires)."""
    if world == 1:
        return None
    if cp_size == world:
        return dist.group.WORLD
    mine = None
    for first in range(0, world, cp_size):
        group = dist.new_group(list(range(first, first + cp_size)))
        if first <= dist.get_rank() < first + cp_size:
            mine = group
    return mine


def pool_batches(batch: Mapping[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """The micro-batches of the ranks of ``group``, concatenated in rank order into one packed
    stream: per-token ``[1, T_r]`` tensors side by side, ``cu_seq_lens_*`` offset and joined,
    ``max_length_*`` the largest; other values are this rank's."""
    if comm.size(group) == 1:
        return dict(batch)
    device = batch["input_ids"].device
    mine = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    parts: list[Any] = [None] * comm.size(group)
    dist.all_gather_object(parts, mine, group=group)
    lengths = [p["input_ids"].shape[1] for p in parts]
    pooled: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _CU_KEYS:
            offsets = torch.tensor([0, *lengths]).cumsum(0)
            joined = [parts[0][key][:1]] + [p[key][1:] + offsets[r] for r, p in enumerate(parts)]
            pooled[key] = torch.cat(joined).to(device, value.dtype)
        elif key in _MAX_KEYS:
            pooled[key] = max(p[key] for p in parts)
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, lengths[comm.rank(group)]):
            pooled[key] = torch.cat([p[key] for p in parts], dim=1).to(device)
        else:
            pooled[key] = value
    return pooled
