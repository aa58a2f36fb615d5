"""Run a function on N local processes joined in one process group (tests, demo, benchmarks).

``torchrun`` is the way to launch real jobs; this is the in-process fallback that needs no
launcher: ``spawn(fn, world_size, *args)`` returns ``[fn(rank, *args) for each rank]``,
gathered from the workers by value.

When something goes wrong it says what went wrong *first*. A rank that raises, or dies
without reporting (a crash, ``os._exit``, the OOM killer), is the root cause; the errors the
other ranks then see ("Connection reset by peer", a collective timeout, an error "reported by
rank r") are its victims, listed after it. Once a rank has failed, the others get a few
seconds to report and are then stopped; once a rank has finished, the others get
``timeout_s`` to finish too. A rank that does neither is *stuck*: its Python stack is dumped
(``faulthandler``) into the error, and it is terminated. So ``spawn`` always returns or raises.

Workers are forked from a ``forkserver`` that has imported torch and doccp once (where the
platform has one; fresh ``spawn`` interpreters elsewhere): a rank starts in ~0.05 s instead of
the ~1.5 s an interpreter takes to import torch, which is most of a small job's time. The
server never runs an op (no thread pools to fork), CUDA stays uninitialised in it, and each
worker takes the caller's environment as it is at the call.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import re
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Seconds the other ranks get to report once one rank has failed.
FAILURE_GRACE = 5.0

#: Modules the forkserver imports once, so that workers start without importing them.
PRELOAD = ["torch", "torch.distributed", "doccp"]

#: Messages of errors that a rank sees *because* a peer failed, not through its own fault.
VICTIM = re.compile(r"Connection (closed|reset) by peer|Broken pipe|[Tt]imed? ?out|reported by rank \d+ of the group|"
                    r"ProcessGroup\w* (is )?(aborted|shut ?down)|NCCL communicator was aborted|Socket Timeout")


@dataclass(frozen=True)
class Failure:
    """How one rank failed: it raised (``kind``, ``message``, ``traceback``), died without
    reporting (``kind == "ProcessDied"``) or was stuck (``kind == "Stuck"``, with its stack)."""

    rank: int
    kind: str
    message: str
    traceback: str
    at: float  # time.monotonic() when it failed (system-wide on one machine)

    @property
    def victim(self) -> bool:
        return self.kind not in ("ProcessDied", "Stuck") and bool(VICTIM.search(self.message))

    def line(self) -> str:
        return f"rank {self.rank} {_verb(self.kind)}: {self.message}"


class WorkerError(RuntimeError):
    """A spawned rank failed. ``rank``/``kind``/``message`` describe the root cause (the first
    rank that failed through its own fault); ``failures`` lists every rank's failure, root first."""

    def __init__(self, failures: list[Failure]):
        root = failures[0]
        text = f"{root.line()}\n{root.traceback}".rstrip()
        if len(failures) > 1:
            text += "\n\nthe other ranks (often consequences of the first failure):\n" + "\n".join(
                "  " + f.line().splitlines()[0][:300] for f in failures[1:])
        super().__init__(text)
        self.rank, self.kind, self.message, self.failures = root.rank, root.kind, root.message, failures


def _verb(kind: str) -> str:
    return {"ProcessDied": "died without reporting", "Stuck": "was stuck"}.get(kind, f"raised {kind}")


def _exit_text(code: int) -> str:
    return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


def _pack(value: Any) -> bytes:
    """Serialise a worker's result by value (tensors shared by handle die with the worker)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def context() -> Any:
    """The multiprocessing context workers start in: a ``forkserver`` preloaded with
    :data:`PRELOAD` where the platform has one (module docstring), else ``spawn``. Queues and
    locks handed to workers must come from this context."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (read when the server starts: the first call's list stays)
    return ctx


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, results: Any,
            threads: int | None, timeout_s: float, backend: str, stack_file: str, environ: dict[str, str]) -> None:
    if os.environ != environ:  # a forked worker has the server's environment: take the caller's
        os.environ.clear()
        os.environ.update(environ)
    stacks = open(stack_file, "w")  # noqa: SIM115 (open for the process's lifetime: faulthandler writes to it)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if threads:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        try:
            results.put((rank, "ok", _pack(fn(rank, *args)), time.monotonic()))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # report every failure to the parent, with its rank and time
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc()), time.monotonic()))


class _Ranks:
    """The parent's view of the workers while it waits for their reports."""

    def __init__(self, procs: list, stack_files: list[str]):
        self.procs, self.stack_files = procs, stack_files
        self.results: dict[int, Any] = {}
        self.failures: list[Failure] = []
        self.silent_since: dict[int, float] = {}

    @property
    def pending(self) -> list[int]:
        done = set(self.results) | {f.rank for f in self.failures}
        return [r for r in range(len(self.procs)) if r not in done]

    def report(self, rank: int, status: str, value: Any, at: float) -> None:
        if status == "ok":
            self.results[rank] = _unpack(value)
        else:
            self.failures.append(Failure(rank, *value, at=at))

    def reap_dead(self) -> None:
        """A rank that exited without reporting failed; its report gets 2 s to arrive through the queue."""
        now = time.monotonic()
        for r in self.pending:
            code = self.procs[r].exitcode
            if code is None:
                continue
            since = self.silent_since.setdefault(r, now)
            if now - since > 2.0:
                self.failures.append(Failure(r, "ProcessDied", _exit_text(code), "", since))

    def stop_stuck(self, why: str) -> None:
        """Dump the Python stack of every pending rank, terminate it, and record it as stuck."""
        alive = []
        for r in self.pending:
            proc = self.procs[r]
            if proc.exitcode is not None:
                self.failures.append(Failure(r, "ProcessDied", _exit_text(proc.exitcode), "", time.monotonic()))
            else:
                os.kill(proc.pid, signal.SIGUSR1)
                alive.append(r)
        time.sleep(0.5)
        for r in alive:
            stacks = Path(self.stack_files[r])
            stack = stacks.read_text(errors="replace").strip() if stacks.exists() else ""
            self.procs[r].terminate()
            self.failures.append(Failure(r, "Stuck", why, f"its stack when stopped:\n{stack}" if stack else "",
                                         time.monotonic()))

    def ordered_failures(self) -> list[Failure]:
        """Root causes first (own errors, deaths, stuck ranks), in time order; then victims."""
        return sorted(self.failures, key=lambda f: (f.victim, f.kind == "Stuck", f.at))


def _collect(ranks: _Ranks, results: Any, timeout_s: float, deadline_s: float | None) -> None:
    start = time.monotonic()
    first_ok = first_failure = None
    while ranks.pending:
        try:
            ranks.report(*results.get(timeout=0.2))
        except queue.Empty:
            ranks.reap_dead()
        now = time.monotonic()
        if ranks.failures and first_failure is None:
            first_failure = now
        if ranks.results and first_ok is None:
            first_ok = now
        if first_failure is not None and now - first_failure > FAILURE_GRACE:
            ranks.stop_stuck(f"still running {FAILURE_GRACE:.0f}s after rank {ranks.failures[0].rank} failed "
                             "(stopped by the launcher)")
        elif first_ok is not None and now - first_ok > timeout_s:
            finished = min(ranks.results)
            ranks.stop_stuck(f"did not finish within timeout_s={timeout_s:g}s after rank {finished} finished")
        elif deadline_s is not None and now - start > deadline_s:
            ranks.stop_stuck(f"did not finish within deadline_s={deadline_s:g}s")


def spawn(fn: Callable, world_size: int, *args: Any, threads: int | None = None, timeout_s: float = 120.0,
          backend: str = "gloo", deadline_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` processes in one process group.

    ``fn`` must be importable (module level). ``threads`` sets torch's intra-op threads per
    rank (default: cores // world_size, at least 1). ``timeout_s`` is the process group's
    timeout (a collective waiting longer raises) and how long the other ranks may run on after
    one rank has finished. ``deadline_s`` bounds the whole run. On any failure raises
    :class:`WorkerError` naming the root cause first (module docstring).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        stack_files = [os.path.join(tmp, f"stack-{r}.txt") for r in range(world_size)]
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results, threads,
                                                   timeout_s, backend, stack_files[r], dict(os.environ)), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        ranks = _Ranks(procs, stack_files)
        try:
            _collect(ranks, results, timeout_s, deadline_s)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    if ranks.failures:
        raise WorkerError(ranks.ordered_failures())
    return [ranks.results[r] for r in range(world_size)]
