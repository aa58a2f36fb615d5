"""Ulysses (all-to-all) CP: trade tokens for heads, attend the whole stream locally, trade back.

Each rank holds ``[T_r, H, D]`` of q, k and v. One all-to-all gives every rank all ``T`` tokens
on ``H / N`` of the heads; it attends them exactly (one slice per document, no LSE merge); a
second all-to-all returns out and lse rows to their owners. No document is cut, so the traffic
does not depend on how the plan cut them, and every rank computes the same work (all pairs on
``H / N`` heads) whatever the plan's balance::

    N = 2, heads h0..h3, rank 0 holds tokens t0 t1 t2, rank 1 holds t3 t4 t5
    all-to-all    rank 0: t0..t5 x h0 h1          rank 1: t0..t5 x h2 h3
    attend        each rank: the whole stream in stream order, on its heads
    all-to-all    rank 0: out t0 t1 t2 x h0..h3   rank 1: out t3 t4 t5 x h0..h3
    backward      dout like q; dq, dk, dv go home like out

GQA: the query heads split evenly (``Hq % N == 0``); so do the KV heads when ``Hkv % N == 0``.
When ``N % Hkv == 0`` each rank receives the one KV head its query heads use, replicated on
``N / Hkv`` ranks (the traffic counts every replica), and the replicas' dK/dV are summed in
fp32 where the KV lives. Any other head count cannot be split: :meth:`Ulysses.problem` says so
on every rank.

The hybrid (:mod:`doccp.algorithms.hybrid`) is this code on a Ulysses group of ``U`` ranks: the
group's tokens are one rank of a plan over the ``R = N / U`` groups (:func:`span_plan`), and the
selective all-gather of that plan runs across the groups on ``H / U`` heads. Plain Ulysses is
``U = N``: the span plan has one rank, whose all-gather moves nothing and attends one slice per
document. Tokens arrive rank after rank and are put in the span plan's order (stream order for
Ulysses) by one row gather (a view when the plan is contiguous): cheaper than attending them
where they land, which cuts every document the plan cut into query x key slices per piece pair.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from doccp import comm
from doccp.algorithms.allgather import AllGather, AllGatherSchedule
from doccp.algorithms.registry import Algorithm, Call, Shapes, register, schedule_of
from doccp.algorithms.work import take_rows
from doccp.plan import Plan
from doccp.plan.pieces import Pieces
from doccp.ranges import expand, starts

#: The all-gather that runs across Ulysses groups (on the span plan; nothing moves for Ulysses).
ACROSS = AllGather()

_spans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def span_plan(plan: Plan, ulysses_size: int) -> Plan:
    """The plan over the ``N / U`` Ulysses groups: group ``a`` holds the tokens of ranks
    ``a*U .. a*U + U - 1``, in (document, position) order (cached per plan and ``U``)."""
    per_plan = _spans.setdefault(plan, {})
    if ulysses_size not in per_plan:
        p = plan.stream_pieces
        pieces = Pieces(p.rank // ulysses_size, p.doc, p.start, p.end).stream_normalized()
        per_plan[ulysses_size] = Plan(plan.layout, plan.world_size // ulysses_size, plan.mask, plan.strategy, pieces)
    return per_plan[ulysses_size]


def heads_problem(shapes: Shapes, size: int, where: str) -> Exception | None:
    """Why the heads of ``shapes`` cannot be split over ``size`` ranks (``where`` names them), or None."""
    hq, hkv = shapes.heads, shapes.kv_heads
    if hq % size:
        return ValueError(f"all-to-all attention splits the query heads over the {size} {where}, but {hq} query "
                          f"heads are not a multiple of {size}; use a head count divisible by {size}, or "
                          "algorithm='allgather' / 'ring_kv' (they split tokens, not heads)")
    if hkv % size and size % hkv:
        return ValueError(f"all-to-all attention gives each of the {size} {where} the KV heads of its {hq // size} "
                          f"query heads, but {hkv} KV heads neither split over {size} ranks nor replicate evenly "
                          f"on them ({size} is not a multiple of {hkv}); use a KV head count that divides or is "
                          f"a multiple of {size}, or algorithm='allgather' / 'ring_kv'")
    return None


def kv_heads(heads: int, kv_heads_total: int, size: int, rank: int) -> slice:
    """The KV heads used by query heads ``[rank*h, (rank+1)*h)``, ``h = heads / size``: ``Hkv / size``
    of them when ``Hkv % size == 0``, else the one they share (a replica)."""
    per_rank, group = heads // size, heads // kv_heads_total
    return slice(rank * per_rank // group, ((rank + 1) * per_rank - 1) // group + 1)


@dataclass(frozen=True)
class UlyssesSchedule:
    """All-to-all inside a Ulysses group, then the all-gather across groups on the span plan."""

    sizes: list[int]  # local tokens of each rank of the Ulysses group (all-to-all rows)
    to_span: torch.Tensor  # rows of the group buffer (its ranks' tokens one after another) in span order
    from_span: torch.Tensor  # and back: the span row of every group buffer row
    span: Plan  # the plan over Ulysses groups
    across: AllGatherSchedule  # this group's all-gather on the span plan


def trade(sends: list[torch.Tensor], recv_rows: list[int], me: int, group: dist.ProcessGroup | None
          ) -> list[torch.Tensor]:
    """All-to-all with exact sizes in a Ulysses group: ``sends[p]`` goes to rank ``p`` (``sends[me]``
    stays) and ``recv_rows[p]`` rows shaped like it come back from each; returns every rank's part."""
    own = sends[me]
    shapes = [None if p == me else (rows, *own.shape[1:]) for p, rows in enumerate(recv_rows)]
    received = comm.exchange([None if p == me else s for p, s in enumerate(sends)], shapes, own, group)
    return [own if p == me else own.new_empty(shapes[p]) if r is None else r for p, r in enumerate(received)]


class Ulysses(Algorithm):
    name = "ulysses"
    summary = ("all-to-all trades tokens for heads: every rank attends the whole stream on H/N heads (traffic "
               "independent of the plan, work perfectly balanced)")

    def ulysses_size(self, plan: Plan) -> int:
        """U: ranks per Ulysses group (every rank, for plain Ulysses)."""
        return plan.world_size

    def groups(self, call: Call) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """The Ulysses group and the group across (unused when the span plan has one rank)."""
        return call.group, None

    def problem(self, plan, shapes, group):
        return heads_problem(shapes, self.ulysses_size(plan), "ranks")

    def schedule(self, plan: Plan, me: int) -> UlyssesSchedule:
        size = self.ulysses_size(plan)
        span, group = span_plan(plan, size), me // size
        # The group buffer holds its ranks' pieces rank after rank (each rank's in local order).
        p = plan.all_pieces
        p = p.select((p.rank // size) == group)
        cu = plan.layout.cu_seqlens
        s = span.rank_pieces(group)
        s_g0, s_row = cu[s.doc] + s.start, starts(s.length)
        g0 = cu[p.doc] + p.start
        piece = torch.searchsorted(s_g0, g0, right=True) - 1
        from_span = expand(s_row[piece] + (g0 - s_g0[piece]), p.length)
        sizes = plan.local_sizes[group * size:(group + 1) * size]
        return UlyssesSchedule(sizes, torch.argsort(from_span), from_span, span, schedule_of(ACROSS, span, group))

    def received_bytes(self, plan: Plan, shapes: Shapes) -> list[int]:
        """In: the other group ranks' tokens on this rank's heads of q, k, v (KV replicas count);
        across: the span plan's all-gather on those heads; back: this rank's tokens on every other
        group rank's heads of out and lse."""
        size, e, d = self.ulysses_size(plan), shapes.element_bytes, shapes.head_dim
        h, hk = shapes.heads // size, kv_heads(shapes.heads, shapes.kv_heads, size, 0).stop
        lse_bytes = 8 if e == 8 else 4  # fp64 inputs have an fp64 lse, the others fp32
        tokens = torch.tensor(plan.local_sizes, dtype=torch.int64).view(-1, size)
        into = (tokens.sum(1, keepdim=True) - tokens) * (h + 2 * hk) * d * e
        back = tokens * (size - 1) * h * (d * e + lse_bytes)
        across = ACROSS.received_bytes(span_plan(plan, size), Shapes(h, hk, d, e))
        return (into + back + torch.tensor(across, dtype=torch.int64)[:, None]).view(-1).tolist()

    def flops(self, plan: Plan, shapes: Shapes) -> list[int]:
        """Every rank of a Ulysses group computes its group's work (all of it, for Ulysses) on
        ``H / U`` heads, whatever the balance of the plan inside the group."""
        size = self.ulysses_size(plan)
        per_group = ACROSS.flops(span_plan(plan, size), Shapes(shapes.heads // size, 1, shapes.head_dim, 0))
        return torch.tensor(per_group, dtype=torch.int64).repeat_interleave(size).tolist()

    def forward(self, q, k, v, call: Call):
        sched: UlyssesSchedule = call.schedule
        size = len(sched.sizes)
        me, inner = call.rank % size, self.groups(call)[0]
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        h = hq // size
        heads = [kv_heads(hq, hkv, size, p) for p in range(size)]
        sends = [torch.cat([q[:, p * h:(p + 1) * h], k[:, heads[p]], v[:, heads[p]]], 1) for p in range(size)]
        rows = take_rows(torch.cat(trade(sends, sched.sizes, me, inner)), sched.to_span)
        hk = heads[me].stop - heads[me].start
        q_s, k_s, v_s = rows.split([h, hk, hk], 1)
        out, lse, saved = ACROSS.forward(q_s, k_s, v_s, self._across_call(call))
        # Out and lse go home in one message: lse's bits ride as extra columns of out's dtype.
        out, lse = take_rows(out, sched.from_span), take_rows(lse.T, sched.from_span).contiguous()
        packed = torch.cat([out.reshape(len(out), h * d), lse.view(out.dtype)], 1)
        parts = trade(list(packed.split(sched.sizes)), [len(q)] * size, me, inner)
        out_local = torch.cat([part[:, :h * d].reshape(-1, h, d) for part in parts], 1)
        lse_local = torch.cat([part[:, h * d:].contiguous().view(lse.dtype) for part in parts], 1)
        return out_local, lse_local.T.contiguous(), (*saved, torch.tensor([hkv]))

    def backward(self, dout, saved, call: Call):
        sched: UlyssesSchedule = call.schedule
        *saved, hkv = saved
        size, hkv, kv_dtype = len(sched.sizes), int(hkv), saved[1].dtype
        me, inner = call.rank % size, self.groups(call)[0]
        h = dout.shape[1] // size
        sends = [dout[:, p * h:(p + 1) * h] for p in range(size)]
        dout_s = take_rows(torch.cat(trade(sends, sched.sizes, me, inner)), sched.to_span)
        dq, dk, dv = ACROSS.backward(dout_s, tuple(saved), self._across_call(call))
        grads = take_rows(torch.cat([dq, dk.to(dq.dtype), dv.to(dq.dtype)], 1), sched.from_span)
        parts = trade(list(grads.split(sched.sizes)), [len(dout)] * size, me, inner)
        dq_local = torch.cat([part[:, :h] for part in parts], 1)
        # dK/dV: each rank's KV heads in rank order, so the replicas of one KV head are neighbours.
        dkv = torch.stack([part[:, h:] for part in parts])  # [size, T, 2 * local KV heads, D]
        replicas = max(size // hkv, 1)
        if replicas > 1:
            wide = torch.promote_types(dkv.dtype, torch.float32)
            dkv = dkv.view(size // replicas, replicas, *dkv.shape[1:]).sum(1, dtype=wide)
        dkv = dkv.permute(1, 0, 2, 3).to(kv_dtype)  # [T, KV head groups, 2 * local KV heads, D]
        local = dkv.shape[2] // 2
        return dq_local, dkv[:, :, :local].flatten(1, 2), dkv[:, :, local:].flatten(1, 2)

    def _across_call(self, call: Call) -> Call:
        sched: UlyssesSchedule = call.schedule
        return Call(sched.span, call.rank // len(sched.sizes), sched.across, call.mask, call.scale, call.backend,
                    self.groups(call)[1])


register(Ulysses())
