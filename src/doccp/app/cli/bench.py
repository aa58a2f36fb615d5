"""Run the benchmark scripts and regenerate docs/benchmarks.md.

Each script in the repository's bench/ folder (plan, kernels, cp, inference, hf) has a
``main(argv)`` that prints one markdown section. This command runs the selected ones, saves
each section to docs/results/<name>.md, and rebuilds docs/benchmarks.md from the machine
description and every saved section, so `--only cp` refreshes one section and keeps the
others. `--assemble` rebuilds the page from the saved sections without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import os
import platform
import re
import sys
import traceback
from pathlib import Path

import torch

from doccp.app.cli.main import UsageError
from doccp.app.cli.progress import Step

SECTIONS = ("plan", "kernels", "cp", "inference", "hf")
REPO = Path(__file__).resolve().parents[3]  # src/doccp/cli/bench.py -> repository root


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a subset that runs in under 5 minutes")
    p.add_argument("--only", metavar="LIST", help=f"comma-separated benchmarks to run (default: all of "
                   f"{','.join(SECTIONS)}); the others keep their saved sections")
    p.add_argument("--assemble", action="store_true",
                   help="run nothing: rebuild the output from the saved sections")
    p.add_argument("--out", metavar="FILE", default=str(REPO / "docs" / "benchmarks.md"),
                   help="page to write (default: docs/benchmarks.md of the repository)")
    p.add_argument("--results", metavar="DIR",
                   help="folder of saved sections <name>.md (default: results/ next to --out)")
    p.add_argument("--bench-dir", metavar="DIR", default=str(REPO / "bench"),
                   help="folder holding the benchmark scripts (default: bench/ of the repository)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    results = Path(args.results) if args.results else out.parent / "results"
    selected = _selected(args.only)
    failed = []
    if not args.assemble:
        bench_dir = Path(args.bench_dir)
        if not bench_dir.is_dir():
            raise UsageError(f"no benchmark folder at {str(bench_dir)!r}; run from a source checkout or pass "
                             "--bench-dir")
        results.mkdir(parents=True, exist_ok=True)
        for name in selected:
            script = bench_dir / f"{name}.py"
            if not script.is_file():
                print(f"doccp bench: {script} not found, keeping the saved {name} section", file=sys.stderr)
                continue
            argv = ["--quick"] if args.quick else []
            try:
                with Step(f"bench {name}{' --quick' if args.quick else ''}"):
                    section = run_script(script, argv)
            except Exception:  # a failing benchmark must not lose the others' results
                print(f"doccp bench: {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
                failed.append(name)
                continue
            stamp = f"<!-- {name}: {_now()}, {machine_line()}{', quick run' if args.quick else ''} -->"
            (results / f"{name}.md").write_text(f"{stamp}\n{section.strip()}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(assemble(results))
    print(f"doccp bench: wrote {out}" + (f" ({', '.join(failed)} failed)" if failed else ""))
    return 1 if failed else 0


def _selected(only: str | None) -> list[str]:
    if not only:
        return list(SECTIONS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise UsageError(f"--only must list some of {','.join(SECTIONS)}, got {only!r}")
    return names


def run_script(script: Path, argv: list[str]) -> str:
    """Import ``script`` and return the markdown its ``main(argv)`` prints (or returns, as a
    string); raise if it fails (an exception, or a non-zero exit code).

    The script's folder goes on ``sys.path`` and the module takes its file name, so ranks
    it spawns can import their worker functions (and the scripts can share helpers).
    """
    folder = str(script.parent.resolve())
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(script.stem, script)
        assert spec is not None and spec.loader is not None
        module = sys.modules[script.stem] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                result = module.main(argv)
        except SystemExit as e:
            result = e.code
    finally:
        sys.path.remove(folder)
        sys.modules.pop(script.stem, None)
    if isinstance(result, str):
        return buffer.getvalue() or result
    if result not in (None, 0):
        raise RuntimeError(f"{script.name} main({argv}) exited with {result}")
    return buffer.getvalue()


def machine_line() -> str:
    """CPU model, cores, GPU (if any), torch and Python versions: one line."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def assemble(results: Path) -> str:
    """The benchmarks page: header, how to reproduce, then every saved section in order,
    each with the machine and date it was measured on."""
    parts = [
        "# doccp benchmarks",
        "",
        f"Page generated {_now()} by `doccp bench` on: {machine_line()}.",
        "Every table compares against its baselines measured in the same run, so ratios stay",
        "meaningful on a noisy machine; absolute times depend on the machine named under each section.",
        "",
        "Reproduce: `make bench` (all, from a fresh checkout), `doccp bench --quick` (a subset in",
        "under 5 minutes), `doccp bench --only cp` (one section; the others are kept from",
        "`docs/results/`), `doccp bench --assemble` (rebuild this page only). The scripts are in",
        "`bench/`; each also runs alone: `python bench/cp.py [--quick]`.",
        "",
    ]
    for name in SECTIONS:
        saved = results / f"{name}.md"
        if not saved.is_file():
            parts += [f"## {name}", "", f"_Not measured yet: `doccp bench --only {name}`._", ""]
            continue
        lines = saved.read_text().strip().splitlines()
        stamp = re.fullmatch(r"<!-- \w+: (.*) -->", lines[0]) if lines else None
        if stamp:
            lines = lines[1:]
            at = 1 if lines and lines[0].startswith("#") else 0
            lines[at:at] = ["", f"_Measured {stamp.group(1)}._"]
        parts += [*lines, ""]
    return "\n".join(parts)
