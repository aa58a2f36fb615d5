"""Collectives over ``torch.distributed`` (gloo on CPU, NCCL on CUDA), with byte counting.

Everything takes a process ``group`` (``None`` = the default group) and speaks in group
ranks; peers are translated to global ranks for point-to-point calls. All calls go through
``torch.distributed`` and so honour the group's timeout. Inside a :func:`measure` block every
byte sent or received is counted, so benchmarks and tests can check volume against a plan;
outside one nothing is counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


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
    me, n = rank(group), size(group)
    ops, received = [], [None] * n
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
