"""The CLI's stderr progress: silent for quick steps, one line per slow step in logs, a tqdm
bar on a terminal that counts progress polled from other processes."""

from __future__ import annotations

import io
import time

from doccp.app.cli.progress import Step


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quick_step_prints_nothing():
    for stream in (io.StringIO(), _Tty()):
        with Step("quick", total=3, stream=stream, delay=5.0) as step:
            step.advance(3)
        assert stream.getvalue() == ""


def test_slow_step_in_a_log():
    stream = io.StringIO()
    with Step("slow", total=2, stream=stream, delay=0.01) as step:
        time.sleep(0.1)
        step.advance(2)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "slow ..." and lines[-1].startswith("slow: done in ")
    assert len(lines) == 2 and "\r" not in stream.getvalue()  # no bar redraws in a log


def test_bar_on_a_terminal_counts_polled_progress():
    stream, pending = _Tty(), [1, 1]
    with Step("ranks", total=2, stream=stream, delay=0.01, poll=lambda: pending.pop() if pending else 0) as step:
        time.sleep(0.8)
    assert step.done == 2
    text = stream.getvalue()
    assert "ranks: 100%" in text and "2/2" in text
    assert text.endswith("ranks: done in " + text.rsplit("ranks: done in ", 1)[1])


def test_bar_without_total_shows_the_elapsed_time():
    stream = _Tty()
    with Step("reading", stream=stream, delay=0.01):
        time.sleep(0.5)
    assert "reading: 00:00" in stream.getvalue()


def test_disabled_and_failed_steps():
    stream = io.StringIO()
    with Step("off", stream=stream, delay=0.0, enabled=False):
        time.sleep(0.05)
    assert stream.getvalue() == ""
    try:
        with Step("boom", stream=stream, delay=0.01):
            time.sleep(0.05)
            raise KeyError
    except KeyError:
        pass
    assert stream.getvalue().splitlines()[-1].startswith("boom: failed in ")
