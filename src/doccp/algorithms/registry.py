"""The CP algorithms as the rest of doccp sees them: one protocol, one registry.

Every algorithm answers the same questions (:class:`Algorithm`):

- ``schedule(plan, rank)``: host-side bookkeeping derived from the plan alone (who sends which
  rows where, which slices each step computes); computed once per (plan, rank) and cached;
- ``forward(q, k, v, call)``: this rank's ``out`` and ``lse``, plus the tensors its backward needs;
- ``backward(dout, saved, call)``: ``dq, dk, dv`` from the forward's *final* out and lse (no
  forward recompute);
- ``received_bytes(plan, shapes)``: what each rank receives in the forward pass, predicted from
  the plan (the byte counts tests check against ``doccp.comm.measure`` and ``auto`` weighs);
- ``flops(plan, shapes)``: the attention FLOPs each rank computes in the forward pass (how
  ``auto`` weighs a plan's work imbalance against traffic);
- ``problem(plan, shapes, group)``: why it cannot run a call (e.g. heads that do not split over
  the ranks), or None;
- ``for_group(group)``: the algorithm as it runs on ``group`` (itself, for most; the hybrid
  reads its Ulysses size and sub-groups from a :class:`~doccp.comm.HybridGroup`).

Prefill-capable algorithms also have ``prefill(q, cache, queries, scale, backend, group)``.
``doccp.attention``, ``doccp.prefill``, ``choose_algorithm``, the CLI, the demo and the
benchmarks read :data:`ALGORITHMS` (and the views :func:`training` / :func:`prefilling`);
none of them keeps a list of names of its own. One autograd function (:class:`CPAttention`)
serves every training algorithm.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from doccp.comm import HybridGroup
from doccp.masks import Mask
from doccp.plan import Plan


@dataclass(frozen=True)
class Shapes:
    """What traffic depends on besides the plan: heads, head dim, bytes per element."""

    heads: int
    kv_heads: int
    head_dim: int
    element_bytes: int

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor) -> Shapes:
        return cls(q.shape[-2], k.shape[-2], q.shape[-1], q.element_size())


@dataclass(frozen=True)
class Call:
    """One attention call, as an algorithm's forward and backward see it."""

    plan: Plan
    rank: int
    schedule: Any
    mask: Mask
    scale: float
    backend: str
    group: dist.ProcessGroup | None


class Algorithm:
    """The protocol every CP algorithm implements (module docstring)."""

    #: Registry name (``doccp.attention(..., algorithm=name)``).
    name: ClassVar[str]
    #: One line for ``doccp plan`` / docs: what travels and when it wins.
    summary: ClassVar[str]
    #: Name under which ``doccp.prefill`` offers it (``None``: training only).
    prefill_name: ClassVar[str | None] = None
    #: Whether ``doccp.attention`` (forward and backward) offers it.
    trains: ClassVar[bool] = True
    #: Whether its transfers hide behind compute where the device allows (GPU copy engines).
    overlaps_compute: ClassVar[bool] = False

    def for_group(self, group: dist.ProcessGroup | HybridGroup | None) -> Algorithm:
        """This algorithm as it runs on ``group``: itself, unless its work depends on how the
        group is built (the hybrid: Ulysses size and sub-groups of a HybridGroup)."""
        return self

    @property
    def cache_key(self) -> Hashable:
        """What its schedules depend on besides the plan and the rank: its name, and any
        configuration :meth:`for_group` gave it."""
        return self.name

    def problem(self, plan: Plan, shapes: Shapes, group: dist.ProcessGroup | HybridGroup | None
                ) -> Exception | None:
        """Why this algorithm cannot run this call (returned, so the ranks can agree), or None."""
        return None

    def schedule(self, plan: Plan, rank: int) -> Any:
        """Host-side bookkeeping of ``rank`` for ``plan`` (cached by :func:`schedule_of`)."""
        raise TypeError(f"the {self.name!r} algorithm has no plan schedule (it does not train)")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """``out`` (q's dtype), ``lse`` (fp32/fp64) and the tensors :meth:`backward` needs."""
        raise TypeError(f"the {self.name!r} algorithm does not train; use one of {sorted(training())}")

    def backward(self, dout: torch.Tensor, saved: tuple[torch.Tensor, ...], call: Call
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise TypeError(f"the {self.name!r} algorithm does not train")

    def received_bytes(self, plan: Plan, shapes: Shapes) -> list[int]:
        """Bytes each rank receives in the forward pass (predicted from the plan)."""
        raise TypeError(f"the {self.name!r} algorithm has no plan-based traffic prediction (it does not train)")

    def flops(self, plan: Plan, shapes: Shapes) -> list[int]:
        """Attention FLOPs each rank computes in the forward pass, ``4 x pairs x heads x head_dim``:
        by default each rank attends its own queries (the plan's work) on every head."""
        return [4 * pairs * shapes.heads * shapes.head_dim for pairs in plan.work]

    def prefill(self, q: torch.Tensor, cache: Any, queries: Any, scale: float, backend: str,
                group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged fp32 ``out``/``lse`` of this rank's new queries (``queries``: every rank's query
        runs) over every rank's KV cache (``cache``: a :class:`~doccp.inference.ShardedKVCache`,
        whose new KV is appended already)."""
        raise TypeError(f"the {self.name!r} algorithm does not prefill; use one of {sorted(prefilling())}")


#: Every registered algorithm, by name.
ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to the registry (its ``name`` must be new)."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"an algorithm named {algorithm.name!r} is registered already")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def training() -> dict[str, Algorithm]:
    """The algorithms ``doccp.attention`` offers, by name."""
    return {name: a for name, a in ALGORITHMS.items() if a.trains}


def prefilling() -> dict[str, Algorithm]:
    """The algorithms ``doccp.prefill`` offers, by their prefill name."""
    return {a.prefill_name: a for a in ALGORITHMS.values() if a.prefill_name is not None}


_schedules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def schedule_of(algorithm: Algorithm | str, plan: Plan, rank: int) -> Any:
    """``algorithm.schedule(plan, rank)`` (an algorithm or its name), computed once per
    configuration (:attr:`Algorithm.cache_key`) and kept as long as the plan lives."""
    algorithm = ALGORITHMS[algorithm] if isinstance(algorithm, str) else algorithm
    plan.check_rank(rank)
    per_plan = _schedules.setdefault(plan, {})
    key = (algorithm.cache_key, rank)
    if key not in per_plan:
        per_plan[key] = algorithm.schedule(plan, rank)
    return per_plan[key]


class CPAttention(torch.autograd.Function):
    """The one autograd function behind every training algorithm: forward and backward are the
    algorithm's own; lse carries no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, algorithm: Algorithm, call: Call):
        out, lse, saved = algorithm.forward(q, k, v, call)
        ctx.save_for_backward(*saved)
        ctx.algorithm, ctx.call = algorithm, call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        dq, dk, dv = ctx.algorithm.backward(dout, ctx.saved_tensors, ctx.call)
        return dq, dk, dv, None, None
