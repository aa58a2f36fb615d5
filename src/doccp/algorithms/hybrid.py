"""Hybrid CP: Ulysses (all-to-all) inside groups of U ranks, selective all-gather across them.

For ``N = U x R`` ranks: the all-to-all, whose traffic per rank does not shrink with N, stays
inside a Ulysses group (one node, fast links); the KV exchange between the R groups moves only
what the queries of a group see of other groups' tokens (documents a group holds whole cost
nothing), on ``H / U`` heads (TransformerEngine's ``a2a+p2p``, USP)::

    N = 4 = U 2 x R 2     ranks 0 1 | 2 3       Ulysses groups {0 1} {2 3}, across {0 2} {1 3}
    all-to-all            rank 0: tokens of ranks 0 and 1 on heads [0, H/2); rank 1: [H/2, H)
    all-gather across     rank 0 <-> rank 2: the KV one group's queries see of the other's tokens
    attend, all-to-all    back to the owners, like Ulysses

The plan stays one plan over N ranks; the groups' tokens form the span plan over R "ranks"
(:func:`~doccp.algorithms.ulysses.span_plan`), whose all-gather schedule runs on the groups
across. Everything else is :class:`~doccp.algorithms.ulysses.Ulysses` on a group of U ranks.

API: make a :class:`doccp.HybridGroup` once, on every process (``dist.new_group`` is collective
over the world, so it cannot happen lazily inside an attention call), and pass it as ``group``::

    cp = doccp.HybridGroup.create(ulysses_size=4)                  # the world is one CP group
    cp = doccp.HybridGroup.create(4, cp_groups=[[0, .., 7], [8, .., 15]])  # DP x CP
    cp = doccp.HybridGroup.from_mesh(mesh["cp_across", "cp_ulysses"])     # a 2-D DeviceMesh
    out = doccp.attention(q, k, v, plan, group=cp, algorithm="hybrid")  # or "auto"

A HybridGroup is a group like any other: every algorithm runs on its whole group, and ``auto``
considers the hybrid only when it is given one.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch.distributed as dist

from doccp.algorithms.registry import Algorithm, Call, register
from doccp.algorithms.ulysses import Ulysses, heads_problem
from doccp.comm import HybridGroup
from doccp.plan import Plan


class Hybrid(Ulysses):
    name = "hybrid"
    summary = ("Ulysses all-to-all inside groups of U ranks (doccp.HybridGroup), selective KV all-gather "
               "across the groups on H/U heads")

    def __init__(self, groups: HybridGroup | None = None):
        self.hybrid = groups

    def for_group(self, group: dist.ProcessGroup | HybridGroup | None) -> Algorithm:
        return Hybrid(group) if isinstance(group, HybridGroup) else self

    @property
    def cache_key(self) -> Hashable:
        return self.name, None if self.hybrid is None else self.hybrid.ulysses_size

    def ulysses_size(self, plan: Plan) -> int:
        return self._configured().ulysses_size

    def groups(self, call: Call) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        return self._configured().ulysses, self._configured().across

    def _configured(self) -> HybridGroup:
        if self.hybrid is None:
            raise TypeError(_NEEDS_GROUP)
        return self.hybrid

    def problem(self, plan, shapes, group):
        if not isinstance(group, HybridGroup):
            return ValueError(_NEEDS_GROUP)
        return heads_problem(shapes, group.ulysses_size, "ranks of each Ulysses group")


_NEEDS_GROUP = ("algorithm='hybrid' needs group=doccp.HybridGroup(...) (Ulysses groups and the groups across them, "
                "made once on every process by HybridGroup.create(ulysses_size) or HybridGroup.from_mesh(mesh))")

register(Hybrid())
