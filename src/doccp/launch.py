"""Run a function on N local processes joined in a gloo group (tests, demo, benchmarks).

``torchrun`` is the way to launch real jobs; this is the in-process fallback that needs no
launcher: ``spawn(fn, world_size, *args)`` returns ``[fn(rank, *args) for each rank]``,
gathered from the workers, and re-raises the first worker error with its rank and traceback.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A spawned rank raised; the message holds its rank and traceback."""

    def __init__(self, rank: int, kind: str, message: str, tb: str):
        super().__init__(f"rank {rank} raised {kind}: {message}\n{tb}")
        self.rank, self.kind, self.message = rank, kind, message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(value: Any) -> bytes:
    """Serialise a worker's result by value (tensors shared by handle die with the worker)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, results: Any,
            threads: int | None, timeout_s: float, backend: str) -> None:
    if threads:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        try:
            results.put((rank, "ok", _pack(fn(rank, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # report every failure to the parent, with its rank
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def _collect(procs: list, results: Any) -> tuple[dict[int, Any], list]:
    """Gather one report per rank; a rank that dies without reporting (killed, segfault) is
    an error too, so the parent never waits forever."""
    out: dict[int, Any] = {}
    errors: list = []
    reported: set[int] = set()
    silent_since: float | None = None
    while len(reported) < len(procs):
        try:
            rank, status, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
            if dead:  # give its report a moment to arrive through the queue's pipe
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since > 5.0:
                    for r in dead:
                        errors.append((r, ("ProcessDied", f"exit code {procs[r].exitcode}", "")))
                        reported.add(r)
            continue
        reported.add(rank)
        if status == "ok":
            out[rank] = _unpack(value)
        else:
            errors.append((rank, value))
    return out, errors


def spawn(fn: Callable, world_size: int, *args: Any, threads: int | None = None,
          timeout_s: float = 120.0, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` processes in one process group.

    ``fn`` must be importable (module level). ``threads`` sets torch's intra-op threads per
    rank (default: cores // world_size, at least 1). Collectives time out after
    ``timeout_s`` seconds instead of hanging.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results, threads,
                                                   timeout_s, backend), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out, errors = _collect(procs, results)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        rank, (kind, message, tb) = min(errors)
        raise WorkerError(rank, kind, message, tb)
    return [out[r] for r in range(world_size)]
