"""DTensor sharding rules for ``doccp::doc_packed_attn`` and its backward.

Attention never mixes batch rows or kv-head groups, so per mesh dimension the ops run locally
(no collective) under three placements of their tensors:

========================  =========  ==========  ==========
tensor                    replicate  batch (DP)  heads (TP)
========================  =========  ==========  ==========
q k v out dout dq dk dv   Replicate  Shard(0)    Shard(2)
lse dlse ``[B, H, S]``    Replicate  Shard(0)    Shard(1)
cu_rows                   Replicate  Shard(0)    Replicate
========================  =========  ==========  ==========

DTensor expands these to every combination over the mesh dimensions (``(Shard(0), Shard(2))``
on a ``("dp", "tp")`` mesh). Heads sharding is offered only where each rank gets whole GQA
groups (the kv heads divide evenly over the head shards); otherwise a rank would pair its q
heads with the wrong kv heads. Uneven batch shards are fine: rows are independent.

Uses the op-strategy API (rather than ``register_sharding``) for that filtering callback.
"""

from __future__ import annotations

import math

from torch._ops import OpOverload
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

#: tensor kind -> its placement under (replicate, batch, heads) on one mesh dimension
_PLACEMENTS = {
    "bshd": (Replicate(), Shard(0), Shard(2)),
    "k": (Replicate(), Shard(0), Shard(2)),  # as bshd; named to find k's spec for the GQA check
    "lse": (Replicate(), Shard(0), Shard(1)),
    "rows": (Replicate(), Shard(0), Replicate()),
}
_FORWARD = {"outputs": ("bshd", "lse"), "inputs": ("bshd", "k", "bshd", "rows")}
_BACKWARD = {"outputs": ("bshd",) * 3, "inputs": ("bshd", "lse", "bshd", "k", "bshd", "bshd", "lse", "rows")}


def _strategy(op_schema: OpSchema, kinds: dict[str, tuple[str, ...]]) -> OpStrategy:
    """The three single-dimension strategies for the tensor args present, expanded to the mesh."""
    present = [kind for kind, arg in zip(kinds["inputs"], op_schema.args_schema, strict=False)
               if isinstance(arg, OpStrategy)]  # an optional dlse may be None
    roles = [*kinds["outputs"], *present]
    single_dim = [[_PLACEMENTS[role][i] for role in roles] for i in range(3)]
    kv_index = present.index("k")
    return expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(), op_schema, single_dim, input_index=len(kinds["outputs"]),
        is_valid_strategy_cb=lambda inputs, _outputs: _whole_kv_groups(inputs[kv_index]))


def _whole_kv_groups(k_spec: DTensorSpec) -> bool:
    """True when ``k``'s heads split evenly over its head shards (so every GQA group stays whole)."""
    shards = math.prod(k_spec.mesh.size(dim) for dim, p in enumerate(k_spec.placements) if p == Shard(2))
    return shards == 1 or (k_spec.tensor_meta is not None and k_spec.tensor_meta.shape[2] % shards == 0)


def register_rules(forward: OpOverload, backward: OpOverload) -> None:
    """Register the strategies; the int/float args after the tensors are static (cache key)."""
    register_op_strategy(forward, schema_info=RuntimeSchemaInfo(4))(lambda s: _strategy(s, _FORWARD))
    register_op_strategy(backward, schema_info=RuntimeSchemaInfo(8))(lambda s: _strategy(s, _BACKWARD))
