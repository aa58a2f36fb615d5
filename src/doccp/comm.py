"""Collectives over ``torch.distributed`` (gloo on CPU, NCCL on CUDA), with byte counting.

Everything takes a process ``group`` (``None`` = the default group) and speaks in group
ranks; peers are translated to global ranks for point-to-point calls. A :class:`HybridGroup`
(a CP group factored into Ulysses groups and the groups across them) stands for its whole
group wherever a group is expected. All calls go through
``torch.distributed`` and so honour the group's timeout. Inside a :func:`measure` block every
byte sent or received is counted, so benchmarks and tests can check volume against a plan;
outside one nothing is counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class Traffic:
    """Bytes moved by this process through doccp's collectives."""

    sent: int = 0
    received: int = 0


_regions: list[Traffic] = []  # the open measure() blocks, innermost last


@contextlib.contextmanager
def measure() -> Iterator[Traffic]:
    """Count the bytes this process sends and receives inside the ``with`` block."""
    region = Traffic()
    _regions.append(region)
    try:
        yield region
    finally:
        _regions.remove(region)


@contextlib.contextmanager
def unmeasured() -> Iterator[None]:
    """Traffic inside this block is nobody's (a calibration's own measurements, say)."""
    saved = _regions[:]
    _regions.clear()
    try:
        yield
    finally:
        _regions[:] = saved


def _count(sent: int = 0, received: int = 0) -> None:
    for region in _regions:
        region.sent += sent
        region.received += received


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def size(group: dist.ProcessGroup | HybridGroup | None = None) -> int:
    return dist.get_world_size(process_group(group)) if dist.is_initialized() else 1


def rank(group: dist.ProcessGroup | HybridGroup | None = None) -> int:
    return dist.get_rank(process_group(group)) if dist.is_initialized() else 0


def process_group(group: dist.ProcessGroup | HybridGroup | None) -> dist.ProcessGroup | None:
    """The process group of every rank of ``group`` (a :class:`HybridGroup`'s whole group)."""
    return group.group if isinstance(group, HybridGroup) else group


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def exchange(sends: Sequence[torch.Tensor | None], recv_shapes: Sequence[tuple[int, ...] | None],
             like: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor | None]:
    """Point-to-point all-to-all with exact sizes: send ``sends[p]`` to group rank ``p`` and
    receive a tensor of ``recv_shapes[p]`` (dtype/device of ``like``) from it. Empty or
    ``None`` entries are skipped on both sides (the caller's plan makes sizes known
    everywhere, so no size handshake is needed)."""
    received: list[torch.Tensor | None] = [None] * len(sends)
    if all(s is None or not s.numel() for s in sends) and all(s is None or 0 in s for s in recv_shapes):
        return received  # nothing to move (a plan of one rank, or nothing shared): no call at all
    me, n = rank(group), size(group)
    ops = []
    for peer in range(n):
        if peer == me:
            continue
        shape = recv_shapes[peer]
        if shape is not None and 0 not in shape:
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            received[peer] = buf
            ops.append(dist.P2POp(dist.irecv, buf, global_rank(group, peer), group))
            _count(received=_nbytes(buf))
        out = sends[peer]
        if out is not None and out.numel():
            out = out.contiguous()
            ops.append(dist.P2POp(dist.isend, out, global_rank(group, peer), group))
            _count(sent=_nbytes(out))
    _wait(dist.batch_isend_irecv(ops) if ops else [])
    return received


class RingStep:
    """One ring hop in flight: send to the next rank, receive from the previous one.

    Start it before computing on the current block so the transfer overlaps compute, and
    call :meth:`wait` when the next block is needed.
    """

    def __init__(self, send: Sequence[torch.Tensor], recv_shapes: Sequence[tuple[int, ...]],
                 like: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
                 direction: int = 1):
        me, n = rank(group), size(group)
        nxt, prv = (me + direction) % n, (me - direction) % n
        self.received = [torch.empty(s, dtype=t.dtype, device=t.device) for s, t in zip(recv_shapes, like, strict=True)]
        ops = []
        for t in send:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t.contiguous(), global_rank(group, nxt), group))
                _count(sent=_nbytes(t))
        for t in self.received:
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, global_rank(group, prv), group))
                _count(received=_nbytes(t))
        self._works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[torch.Tensor]:
        _wait(self._works)
        return self.received


def _wait(works) -> None:
    for w in works:
        w.wait()


def all_gather_varsize(x: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None = None,
                       dim: int = 0) -> list[torch.Tensor]:
    """All-gather tensors whose ``dim`` sizes differ by rank (``sizes`` known everywhere):
    pads to the largest, gathers uniform buffers, trims."""
    n = size(group)
    if n == 1:
        return [x.narrow(dim, 0, sizes[0])]
    longest = max(sizes)
    if x.shape[dim] < longest:
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim)
    x = x.contiguous()
    buffers = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(buffers, x, group=group)
    _count(sent=_nbytes(x) * (n - 1), received=_nbytes(x) * (n - 1))
    return [b.narrow(dim, 0, s) for b, s in zip(buffers, sizes, strict=True)]


def host_collectives(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` runs collectives on CPU tensors (gloo, or a ``cpu:gloo,cuda:nccl`` group)."""
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):  # older torch: the backend name alone
        config = str(dist.get_backend(group))
    return "gloo" in config or "mpi" in config


def device_of(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a device-only group's collectives take their tensors (this process's current GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_group(world_size: int, group: dist.ProcessGroup | None, what: str = "plan") -> BaseException | None:
    """The problem (not raised) if a plan for ``world_size`` ranks meets a group of another size."""
    n = size(group)
    if world_size != n and not dist.is_initialized():
        return ValueError(f"the {what} is for world_size={world_size}, but no process group is initialised: "
                          "start one rank per process with torchrun and torch.distributed.init_process_group(), "
                          "or run a function on local ranks with doccp.launch.spawn(fn, world_size); a plan "
                          "for world_size=1 runs without a process group")
    if world_size != n:
        return ValueError(f"the {what} is for world_size={world_size} but the process group has {n} "
                          f"ranks; build the plan with world_size={n} (or pass the matching group)")
    return None


@dataclass(frozen=True, eq=False)
class HybridGroup:
    """A CP group of ``N = U x R`` ranks seen as ``R`` Ulysses groups of ``U`` consecutive ranks.

    CP rank ``r = a * U + u`` is rank ``u`` of Ulysses group ``a`` and rank ``a`` of its group
    *across* (the R ranks whose Ulysses rank is ``u``)::

        N = 8, U = 4, R = 2    CP ranks 0 1 2 3 | 4 5 6 7
        Ulysses groups         {0 1 2 3} {4 5 6 7}          all-to-all inside (one node: fast links)
        groups across          {0 4} {1 5} {2 6} {3 7}      KV exchange between (across nodes)

    Pass it where ``doccp.attention`` takes ``group``: every algorithm runs on the whole group,
    and ``algorithm="hybrid"`` (or ``"auto"``) uses the factorisation. ``dist.new_group`` must be
    called by every process of the world, so the groups are made once, up front, by
    :meth:`create` or :meth:`from_mesh` (never lazily inside an attention call).
    """

    group: dist.ProcessGroup | None  # all N CP ranks (None: the default group)
    ulysses: dist.ProcessGroup  # this rank's Ulysses group (U ranks)
    across: dist.ProcessGroup  # the R ranks with this rank's Ulysses rank, one per Ulysses group

    @classmethod
    def create(cls, ulysses_size: int, cp_groups: Sequence[Sequence[int]] | None = None,
               timeout: timedelta | None = None) -> HybridGroup:
        """Make the groups of every CP group; every process of the world calls it, with the same
        arguments. ``cp_groups``: the global ranks of each CP group (default: the world is one CP
        group), e.g. ``[[0, 1, 2, 3], [4, 5, 6, 7]]`` for DP = 2 x CP = 4; each is factored into
        Ulysses groups of ``ulysses_size`` consecutive members. Returns this process's."""
        world = dist.get_world_size()
        whole = [list(range(world))] if cp_groups is None else [[int(r) for r in g] for g in cp_groups]
        if sorted(r for g in whole for r in g) != list(range(world)):
            raise ValueError(f"cp_groups must hold every rank of the world (0..{world - 1}) exactly once, got {whole}")
        sizes = sorted({len(g) for g in whole})
        u = ulysses_size
        if isinstance(u, bool) or not isinstance(u, int) or u < 1 or any(size % u for size in sizes):
            raise ValueError(f"ulysses_size must be an int >= 1 that divides the size of every CP group "
                             f"({', '.join(map(str, sizes))}), got {ulysses_size!r}")
        group = None if cp_groups is None else dist.new_subgroups_by_enumeration(whole, timeout=timeout)[0]
        ulysses = [g[i:i + u] for g in whole for i in range(0, len(g), u)]
        across = [g[i::u] for g in whole for i in range(u)]
        return cls(group, *(dist.new_subgroups_by_enumeration(groups, timeout=timeout)[0]
                            for groups in (ulysses, across)))

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> HybridGroup:
        """From a 2-D ``DeviceMesh`` of shape ``(R, U)``: dimension 0 across, dimension 1 Ulysses
        (e.g. ``mesh["cp_across", "cp_ulysses"]`` of a DP x CP mesh). Every process of the world
        calls it: the whole CP group is the mesh flattened (``DeviceMesh._flatten``, made once)."""
        if mesh.ndim != 2:
            raise ValueError(f"mesh must be a 2-D DeviceMesh (across, ulysses), got {mesh.ndim} dimensions; "
                             "slice a larger mesh by name, e.g. mesh['cp_across', 'cp_ulysses']")
        return cls(mesh._flatten().get_group(), mesh.get_group(1), mesh.get_group(0))

    @property
    def ulysses_size(self) -> int:
        """U: ranks per Ulysses group."""
        return dist.get_world_size(self.ulysses)

    @property
    def across_size(self) -> int:
        """R: Ulysses groups (ranks per group across)."""
        return dist.get_world_size(self.across)

    def problem(self) -> BaseException | None:
        """What makes the three groups inconsistent (returned, so the ranks can agree), or None."""
        return self._problem

    @cached_property
    def _problem(self) -> BaseException | None:
        whole = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        u, a, n_u = dist.get_rank(self.ulysses), dist.get_rank(self.across), self.ulysses_size
        ulysses, across = (dist.get_process_group_ranks(g) for g in (self.ulysses, self.across))
        if u < 0 or a < 0 or n_u * self.across_size != len(whole) or ulysses != whole[a * n_u:(a + 1) * n_u] \
                or across != whole[u::n_u]:
            return ValueError(f"the HybridGroup's groups do not factor its whole group {whole} as Ulysses groups of "
                              f"consecutive ranks (this rank's: {ulysses}) times the groups across them (this rank's: "
                              f"{across}); build it with doccp.HybridGroup.create(ulysses_size) or "
                              "HybridGroup.from_mesh(mesh)")
        return None
