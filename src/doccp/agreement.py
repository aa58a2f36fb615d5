"""Ranks agree before they communicate: the same error on every rank, never a hang or garbage.

Every collective entry point (``attention``, ``prefill``, ``decode``, ``unshard``, the padded
API) first calls :func:`agree` with what this rank found wrong with its own arguments (or
``None``) and the *fields* that must be equal on every rank: the plan's fingerprint, the
algorithm, head counts, dtype, ... One small collective tells every rank whether anyone found
a problem or disagrees; only then does a second one fetch the messages, and every rank raises
the same error naming the ranks involved::

    rank 0: attention(q0, k0, v0, plan)        rank 1: attention(q1, k1, v1, other_plan)
              |  agree: [ok, fp(plan), ...]              |  agree: [ok, fp(other_plan), ...]
              +------------- all-reduce (max, -min) -----+
    both raise: ValueError("ranks disagree on the plan: rank 0 has Plan(balanced, ...), rank 1 ...")

**Symmetry.** Whether a rank takes part in the agreement must not depend on anything that can
differ between ranks (a cache, its own inputs), or a healthy rank would skip it while a broken
one waits in it. On groups that can run CPU collectives (gloo, and ``cpu:gloo,cuda:nccl``) every
call agrees: one all-reduce of a few int64 on the host, tens of microseconds, no device sync.
On device-only groups (NCCL alone) reading the result would synchronise the device on every
call, so there each distinct call (plan fingerprint and fields) agrees once and is remembered;
a later call whose arguments are broken on one rank only then fails at the group's timeout
instead of at once. Give NCCL jobs a CPU backend too (``init_process_group("cpu:gloo,cuda:nccl")``)
to get per-call agreement there.

The **plan fingerprint** is a 64-bit hash of everything that makes two plans differ: layout,
world size, mask, strategy and the pieces themselves; computed once per plan object (exact
int64 arithmetic, the same on every rank whatever its thread count).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist

from doccp import comm

#: Fields of one call: name -> a value with a stable ``repr`` (ints, strings, tuples, None).
Fields = Mapping[str, object]

_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_agreed: set[tuple] = set()  # device-only groups: (group members, field hashes) agreed before


def agree(problem: BaseException | None, group: dist.ProcessGroup | comm.HybridGroup | None, fields: Fields) -> None:
    """Raise on every rank if any rank has a ``problem`` or the ranks' ``fields`` differ.

    Without a process group (or on a group of one) it simply raises ``problem``. A
    :class:`~doccp.comm.HybridGroup` agrees on its whole group.
    """
    group = comm.process_group(group)
    if not dist.is_initialized() or comm.size(group) == 1:
        if problem is not None:
            raise problem
        return
    hashes = [stable_hash((name, value)) for name, value in fields.items()]
    members = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    host = comm.host_collectives(group)
    if not host and problem is None and (members, tuple(hashes)) in _agreed:
        return
    status = torch.tensor([0 if problem is None else 1, *hashes], dtype=torch.int64)
    both = torch.cat([status, -status])
    if not host:
        both = both.to(comm.device_of(group))
    dist.all_reduce(both, dist.ReduceOp.MAX, group=group)
    high, low = both.cpu().view(2, -1)
    low = -low
    if int(high[0]) == 0 and bool((high == low).all()):
        if not host:
            _agreed.add((members, tuple(hashes)))
        return
    _raise_together(problem, group, fields)


def _raise_together(problem: BaseException | None, group: dist.ProcessGroup | None, fields: Fields) -> None:
    """Second round, only when something is wrong: fetch every rank's problem and fields, and
    raise the same story on every rank (a rank's own problem in its own words)."""
    me, n = comm.rank(group), comm.size(group)
    mine = (None if problem is None else (type(problem).__name__, str(problem)),
            {name: _describe(value) for name, value in fields.items()})
    everyone: list = [None] * n
    dist.all_gather_object(everyone, mine, group=group)
    for r, (found, _) in enumerate(everyone):
        if found is not None:
            kind, message = found
            cls = TypeError if kind == "TypeError" else ValueError
            raise cls(message if r == me else f"{message} (reported by rank {r} of the group)")
    for name in fields:
        values = [described[name] for _, described in everyone]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for r, value in enumerate(values):
                groups.setdefault(value, []).append(r)
            told = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}: {value}" for value, rs in groups.items())
            hint = (": build it on every rank from the same layout, world size, mask and strategy (a data loader "
                    "that gives every CP rank the same batch)") if name == "plan" else ""
            raise ValueError(f"the ranks of the group disagree on {name} ({told}); every rank must make the "
                             f"same call with the same {name}{hint}")
    raise RuntimeError("the ranks' agreement failed, but no rank reports a problem")  # pragma: no cover


def fingerprint(plan: object) -> int:
    """64-bit hash of a plan's layout, world size, mask, strategy and pieces (cached per plan)."""
    if plan in _fingerprints:
        return _fingerprints[plan]
    p = plan.stream_pieces
    parts = [stable_hash(("plan", plan.world_size, repr(plan.mask), plan.strategy)),
             tensor_hash(plan.layout.cu_seqlens), *(tensor_hash(c) for c in (p.rank, p.doc, p.start, p.end))]
    value = stable_hash(tuple(parts))
    _fingerprints[plan] = value
    return value


def describe_plan(plan: object) -> str:
    """What a human needs to see two plans differ, in one line."""
    layout = plan.layout
    return (f"Plan({plan.strategy}, world_size={plan.world_size}, mask {plan.mask}, {layout.num_docs} documents, "
            f"{layout.num_tokens} tokens, fingerprint {fingerprint(plan) & (2**64 - 1):016x})")


def stable_hash(value: object) -> int:
    """A signed 64-bit hash of ``repr(value)``, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


# Odd 64-bit multipliers (as signed int64) for tensor_hash.
_K1, _K2 = -7046029254386353131, -4658895280553007687


def tensor_hash(t: torch.Tensor) -> int:
    """Order-sensitive 64-bit hash of an integer tensor: ``sum(mix(t[i] + i))`` in wrapping int64
    arithmetic, which is exact and independent of how the sum is split over threads."""
    t = t.reshape(-1).to(torch.int64)
    index = torch.arange(t.numel(), dtype=torch.int64)
    x = (t * _K1) ^ (index * _K2)
    x = x ^ (x >> 29)
    return stable_hash((t.numel(), int((x * _K1).sum())))


def _describe(value: object) -> str:
    return value if isinstance(value, str) else repr(value)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
