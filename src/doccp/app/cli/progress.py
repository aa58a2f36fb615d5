"""A one-line progress indicator on stderr for steps that take more than a second.

No dependency: a background thread redraws ``label [####----] 2/4  3.1s`` (or a spinner
when the total is unknown) on a terminal; on a pipe or log file it writes one line when a
step turns out slow and one when it ends, so logs stay readable. Quick steps print nothing.
stdout is left alone for the report.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

SPINNER = "|/-\\"


class Step:
    """``with Step("planning", total=3) as step: ... step.advance()``.

    ``poll`` (optional) is called on every redraw and returns how many units finished
    since the last call: how progress reported by other processes reaches the line.
    ``enabled=False`` makes it silent (e.g. on every rank but the one that reports).
    """

    def __init__(self, label: str, total: int | None = None, *, stream: TextIO | None = None,
                 delay: float = 1.0, poll: Callable[[], int] | None = None, enabled: bool = True):
        self.label, self.total, self.done, self.enabled = label, total, 0, enabled
        self.stream = stream or sys.stderr
        self.delay, self.poll = delay, poll
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._shown = False
        self._start = 0.0

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def __enter__(self) -> Step:
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()
        if self._shown:
            status = "done" if kind is None else "failed"
            end = f"{self.label}: {status} in {self.elapsed:.1f}s"
            self._write(("\r\033[K" if self.tty else "") + end + "\n")

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        self._shown = True
        if not self.tty:
            self._write(f"{self.label} ...\n")
        tick = 0
        while True:
            if self.poll is not None:
                self.advance(self.poll())
            if self.tty:
                self._write("\r\033[K" + self._line(tick))
            tick += 1
            if self._stop.wait(0.2):
                return

    def _line(self, tick: int) -> str:
        with self._lock:
            done = self.done
        if self.total:
            width = 20
            filled = min(width, width * done // self.total)
            meter = f"[{'#' * filled}{'-' * (width - filled)}] {done}/{self.total}"
        else:
            meter = SPINNER[tick % len(SPINNER)]
        return f"{self.label} {meter}  {self.elapsed:.1f}s"

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
