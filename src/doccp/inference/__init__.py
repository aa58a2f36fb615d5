"""CP inference: prefill over a sharded KV cache (ring pass-KV or pass-Q), then decode.

Per attention layer, one :class:`ShardedKVCache` per rank::

    cache = doccp.ShardedKVCache.for_group(group)
    plan = doccp.plan(doccp.DocLayout.from_lengths(prompt_lengths), N, doccp.Mask.causal())
    out = doccp.prefill(q, k, v, plan, cache, group)          # q/k/v: this rank's prompt tokens
    for step in range(steps):                                 # q/k/v: [B, heads, D], one token each
        out = doccp.decode(q, k, v, cache, group, gather=True)

Positions continue from the cached length: a later prefill (the next turn of a chat) takes
a plan over the *new* tokens and sees everything cached before. RoPE positions of the new
tokens are ``cache.lengths[doc] + plan.positions(rank)`` (prefill) and ``cache.lengths``
(decode), read before the call.

- :mod:`~doccp.inference.cache`: where every sequence's KV lives, and the local storage.
- :mod:`~doccp.inference.prefill`: pass-KV and pass-Q prefill.
- :mod:`~doccp.inference.decode`: decode with outputs merged on each sequence's owner.
- :mod:`~doccp.inference.heuristic`: Algorithm 5, calibrated on the group.
- :mod:`~doccp.kernels.runs`: the compact description of cached positions and its slices.
"""

from doccp.inference.cache import ShardedKVCache
from doccp.inference.decode import decode
from doccp.inference.heuristic import Calibration, calibrate, choose_prefill_algorithm
from doccp.inference.prefill import prefill

__all__ = ["ShardedKVCache", "prefill", "decode", "choose_prefill_algorithm", "calibrate", "Calibration"]
