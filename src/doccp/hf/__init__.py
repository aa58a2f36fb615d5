"""Hugging Face transformers integration: CP training of causal LMs on packed, padding-free batches.

Ten lines on top of an ordinary transformers training step (``pip install doccp[hf]``)::

    import doccp.hf
    doccp.hf.register()                                      # attn_implementation="doccp"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="doccp")
    collator = DataCollatorWithFlattening()                  # padding-free packed batches
    for batch in loader:                                     # the same batch on every CP rank
        local = doccp.hf.shard_batch(batch, group=cp_group)  # this rank's tokens + the plan
        model(**local).loss.backward()                       # summed over the group = the mean loss
        doccp.hf.all_reduce_gradients(model, cp_group)       # gradients are parts of one sum
        optimizer.step(); optimizer.zero_grad()

``register`` makes doccp an attention implementation of transformers; ``shard_batch`` turns a
``DataCollatorWithFlattening`` batch into the rank's part of it, with the plan that carries the
document layout through the model to every attention layer; :class:`CPTrainer` does the same
inside ``transformers.Trainer``. See docs/hf.md for what is and is not supported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from doccp.hf.attention import layer_mask, register
from doccp.hf.batch import PLAN_KWARG, BatchPlan, ShardedBatch, shard_batch
from doccp.hf.gradients import all_reduce_gradients

__all__ = ["register", "layer_mask", "shard_batch", "ShardedBatch", "BatchPlan", "PLAN_KWARG",
           "all_reduce_gradients", "CPTrainer"]


def __getattr__(name: str):
    if name == "CPTrainer":  # imports transformers.Trainer (and accelerate): only when asked for
        value = importlib.import_module("doccp.hf.trainer").CPTrainer
        globals()[name] = value
        return value
    raise AttributeError(f"module 'doccp.hf' has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from doccp.hf.trainer import CPTrainer  # noqa: F401
