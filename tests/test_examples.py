"""The examples run as documented (spawn fallback, no launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_train_cp_spawn_fallback():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(EXAMPLES / "train_cp.py"), "--world-size", "2", "--steps", "2",
                          "--tokens", "1024", "--max-doc-len", "300"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "step 0 loss matches one process" in run.stdout
    assert [line.split()[:2] for line in run.stdout.splitlines() if line.startswith("step ") and "loss " in line
            and "matches" not in line] == [["step", "0"], ["step", "1"]]


def test_hf_train_spawn_fallback():
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(EXAMPLES / "hf_train.py"), "--world-size", "2", "--steps", "2",
                          "--tokens", "1024", "--max-doc-len", "300"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    steps = [line.split() for line in run.stdout.splitlines() if line.startswith("step ")]
    assert [s[:2] for s in steps] == [["step", "0"], ["step", "1"]]
    assert all(s[3] == s[7] for s in steps), steps  # CP loss == one process's, as printed
    assert "the CP loss curve equals one process's over 2 steps" in run.stdout
