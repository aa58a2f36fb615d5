"""Host index tables on an accelerator: copied without stalling the host, once per device.

Plans and schedules are host tensors (rows to send to each peer, how to arrange received KV,
a ring block's rows), computed once per batch and used by every attention layer of the model.
``host.to("cuda")`` from pageable memory makes PyTorch synchronise the stream after the copy:
the host waits for every kernel already queued, and the GPU then idles while the host queues
the next ones (5.5 ms in each attention layer but the first of a 4-layer Llama at 32k tokens on
an H100: docs/gpu.md). :func:`to_device` copies through pinned memory without blocking;
:func:`on_device` does so once per (host tensor, device) and hands later layers the same copy.
"""

from __future__ import annotations

import weakref

import torch

#: (id of a host tensor, device) -> its copy there; an entry goes when its host tensor does.
_COPIES: dict[tuple[int, str], torch.Tensor] = {}


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``; a CPU tensor goes to a CUDA device through one pinned,
    non-blocking copy (the pinned buffer is recycled only after the copy has run)."""
    device = torch.device(device)
    if _already_there(host, device):
        return host
    if host.device.type == "cpu" and device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def on_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """:func:`to_device`, remembered while ``host`` lives: for tables that never change after
    they are built (a plan's or a schedule's), which every layer of a model reads again."""
    device = torch.device(device)
    if _already_there(host, device):
        return host
    key = (id(host), str(device))
    copy = _COPIES.get(key)
    if copy is None:
        copy = _COPIES[key] = to_device(host, device)
        weakref.finalize(host, _COPIES.pop, key, None)
    return copy


def _already_there(host: torch.Tensor, device: torch.device) -> bool:
    """``host`` is on ``device`` (any CPU tensor counts as on ``cpu``)."""
    return host.device == device or (device.type == "cpu" and host.device.type == "cpu")
