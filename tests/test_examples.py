"""The examples run as documented (spawn fallback, no launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
