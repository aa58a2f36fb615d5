"""Progress on stderr for the CLI's steps that may take more than a second.

On a terminal a tqdm bar appears once a step has run for ``delay`` seconds (a bar with a
count when the total is known, the elapsed time otherwise) and is replaced by
``label: done in 3.1s`` at the end. On a pipe or a log file there is no bar: one line when a
step turns out slow and one when it ends, so logs stay readable. Quick steps print nothing,
and stdout is left alone for the report.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

#: Seconds between two polls of ``poll`` and redraws of the bar.
TICK = 0.2


class Step:
    """``with Step("planning", total=3) as step: ... step.advance()``.

    ``poll`` (optional) is called on every tick and returns how many units finished since
    the last call: how progress reported by other processes (spawned ranks) reaches the bar.
    ``enabled=False`` makes it silent (e.g. on every rank but the one that reports).
    """

    def __init__(self, label: str, total: int | None = None, *, stream: TextIO | None = None,
                 delay: float = 1.0, poll: Callable[[], int] | None = None, enabled: bool = True):
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream or sys.stderr
        self.delay, self.poll = delay, poll
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._bar: tqdm | None = None
        self._done = 0
        self._start = 0.0

    @property
    def done(self) -> int:
        return self._done

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self._done += n
            if self._bar is not None:
                self._bar.update(n)  # tqdm itself waits for ``delay`` and throttles redraws

    def __enter__(self) -> Step:
        self._start = time.perf_counter()
        if not self.enabled:
            return self
        if self.tty:
            fmt = None if self.total else "{desc}: {elapsed}"
            self._bar = tqdm(total=self.total, desc=self.label, file=self.stream, delay=self.delay, leave=False,
                             dynamic_ncols=True, mininterval=TICK, bar_format=fmt)
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        self._stop.set()
        self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._bar.close()  # leave=False: clears its line
        if self.elapsed >= self.delay:
            self._write(f"{self.label}: {'done' if kind is None else 'failed'} in {self.elapsed:.1f}s\n")

    def _tick(self) -> None:
        if not self.tty and not self._stop.wait(self.delay):
            self._write(f"{self.label} ...\n")  # a log gets one line when the step turns out slow
        while not self._stop.wait(TICK):
            polled = self.poll() if self.poll is not None else 0
            with self._lock:
                self._done += polled
                if self._bar is not None:
                    self._bar.update(polled)
                    if self.elapsed >= self.delay:
                        self._bar.refresh()  # the elapsed time moves on without progress too

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
