"""doccp: exact, balanced context-parallel attention over packed variable-length documents.

layout -> plan -> shard -> attention -> unshard::

    layout = doccp.DocLayout.from_lengths([48, 56, 58, 35])
    plan = doccp.plan(layout, world_size, doccp.Mask.causal())     # balanced by default
    q, k, v = (doccp.shard(t, plan, rank) for t in (q, k, v))      # this rank's tokens
    out = doccp.attention(q, k, v, plan)                           # exact, across ranks
    full = doccp.unshard(out, plan)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.plan import Plan, PlanStats, plan
from doccp.shard import shard, unshard

__version__ = "0.1.0"

# Public names defined in submodules, imported on first use (keeps `import doccp` light).
_LAZY = {
    "varlen_attention": "doccp.varlen",
    "attention": "doccp.algorithms",
    "choose_algorithm": "doccp.algorithms",
    "HybridGroup": "doccp.comm",
    "ShardedKVCache": "doccp.inference",
    "prefill": "doccp.inference",
    "decode": "doccp.inference",
    "choose_prefill_algorithm": "doccp.inference",
    "doc_packed_attn": "doccp.interop.doc_packed",
    "shard_padded": "doccp.interop.padded",
    "unshard_padded": "doccp.interop.padded",
    "padded_attention": "doccp.interop.padded",
    "nn": "doccp.nn",
}

__all__ = ["DocLayout", "Mask", "Plan", "PlanStats", "plan", "shard", "unshard", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        value = module if _LAZY[name] == f"doccp.{name}" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'doccp' has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from doccp import nn  # noqa: F401
    from doccp.algorithms import attention, choose_algorithm  # noqa: F401
    from doccp.comm import HybridGroup  # noqa: F401
    from doccp.inference import ShardedKVCache, choose_prefill_algorithm, decode, prefill  # noqa: F401
    from doccp.interop.doc_packed import doc_packed_attn  # noqa: F401
    from doccp.interop.padded import padded_attention, shard_padded, unshard_padded  # noqa: F401
    from doccp.varlen import varlen_attention  # noqa: F401
