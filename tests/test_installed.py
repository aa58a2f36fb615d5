"""The wheel as a user installs it: built from the sources, installed outside the checkout,
and its ``doccp`` command run from another directory, where no repository is in sight."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(the installed ``doccp`` script, its environment): the wheel, built from a copy of the
    sources (no build/ left in the checkout) and installed with ``--target`` (its dependencies
    come from this test's environment through PYTHONPATH)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]  # faster
    subprocess.run([*pip, "wheel", "--no-deps", *isolation, "-w", str(work / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (work / "dist").glob("doccp-*.whl")
    target = work / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONUNBUFFERED": "1"}
    return target / "bin" / "doccp", env


def doccp(installed, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    script, env = installed
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_installed_package_is_the_wheel(installed, tmp_path):
    script, env = installed
    proc = subprocess.run([sys.executable, "-c", "import doccp; print(doccp.__file__)"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert Path(proc.stdout.strip()).is_relative_to(script.parents[1])  # not the checkout's src/


def test_plan_and_demo_from_another_directory(installed, tmp_path):
    proc = doccp(installed, "plan", "--lengths", "300", "40", "1000", "-n", "2", "--plot", "p.png", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "3 documents, 1340 tokens, 2 ranks" in proc.stdout and (tmp_path / "p.png").is_file()
    proc = doccp(installed, "demo", "--world-size", "2", "--tokens", "1024", "--decode-tokens", "2",
                 "--algorithms", "allgather", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith("PASS in ")
    assert (tmp_path / "doccp-demo" / "report.md").is_file()


def test_bench_says_where_the_scripts_live_and_takes_a_bench_dir(installed, tmp_path):
    proc = doccp(installed, "bench", "--quick", "--out", "results", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "results").exists()
    assert "the benchmark scripts live in the doccp source repository" in proc.stderr
    assert "--bench-dir" in proc.stderr and "Traceback" not in proc.stderr
    bench = tmp_path / "scripts"
    bench.mkdir()
    (bench / "plan.py").write_text("def main(argv=None):\n    print('## plan', argv)\n")
    proc = doccp(installed, "bench", "--quick", "--only", "plan", "--bench-dir", str(bench), "--out", "results",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "## plan ['--quick']" in (tmp_path / "results" / "benchmarks.md").read_text()
