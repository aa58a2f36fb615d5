"""Run the benchmark scripts and assemble their sections into one markdown page.

Each script in a doccp source checkout's bench/ folder (plan, optimum, kernels, cp, inference, hf) has a
``main(argv)`` that prints one markdown section. This command runs the selected ones, saves
each section to OUT/results/<name>.md and rebuilds OUT/benchmarks.md from the machine
description and every saved section, so `--only cp` refreshes one section and keeps the
others. `--assemble` rebuilds the page from the saved sections without running anything.

Where results go: only a complete, successful, full (not --quick) run writes the checkout's
docs/ pages, which is the default OUT for such runs. A --quick run writes to --out DIR
(default ./doccp-bench), and so does a run in which a benchmark fails or is interrupted:
the documented numbers are never replaced by a subset or a partial run.

Finding the scripts: --bench-dir DIR, else ./bench when it holds them, else bench/ of the
source checkout this doccp runs from (an editable install). An installed wheel carries no
benchmark scripts: run from a checkout of the repository, or pass --bench-dir.
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
from dataclasses import dataclass
from pathlib import Path

import torch

import doccp
from doccp.app.cli.main import UsageError
from doccp.app.cli.progress import Step

SECTIONS = ("plan", "optimum", "kernels", "cp", "inference", "hf")
#: Where --quick runs, failed runs and runs without a source checkout write by default.
SCRATCH = Path("doccp-bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--quick", action="store_true", help="a subset that runs in under 5 minutes (never written to "
                   "the docs pages)")
    p.add_argument("--only", metavar="LIST", help=f"comma-separated benchmarks to run (default: all of "
                   f"{','.join(SECTIONS)}); the others keep their saved sections")
    p.add_argument("--assemble", action="store_true",
                   help="run nothing: rebuild OUT/benchmarks.md from the sections saved in OUT/results")
    p.add_argument("--out", metavar="DIR",
                   help="folder for benchmarks.md and results/<name>.md (default: docs/ of the source checkout "
                        f"for a full run, ./{SCRATCH} otherwise)")
    p.add_argument("--bench-dir", metavar="DIR",
                   help="folder holding the benchmark scripts (default: ./bench, else bench/ of the source "
                        "checkout doccp runs from)")


@dataclass
class Section:
    name: str
    text: str
    ok: bool


def run(args: argparse.Namespace) -> int:
    selected = _selected(args.only)
    if args.assemble:
        out = _explicit_out(args) or _checkout_docs(_find_bench_dir(args.bench_dir, required=False)) or SCRATCH
        _write_page(out)
        return 0
    bench_dir = _find_bench_dir(args.bench_dir, required=True)
    docs = _checkout_docs(bench_dir)
    out = _explicit_out(args)
    if args.quick and out is not None and docs is not None and out.resolve() == docs.resolve():
        raise UsageError(f"--quick results never replace the documented ones in {docs}; pass another --out DIR")

    sections = [_run_one(bench_dir, name, args.quick) for name in selected]
    sections = [s for s in sections if s is not None]
    failed = [s.name for s in sections if not s.ok]
    complete = not failed and not args.quick
    if out is None:
        out = docs if complete and docs is not None else SCRATCH
    elif docs is not None and out.resolve() == docs.resolve() and not complete:
        out = SCRATCH  # an explicit --out docs/ still gets only complete runs
    for s in sections:
        _save(out / "results", s, args.quick)
    _write_page(out)
    if failed:
        print(f"doccp bench: {', '.join(failed)} failed or stopped early; this run's sections are in {out}/results"
              + (f", {docs} is unchanged" if docs is not None and out != docs else ""), file=sys.stderr)
    return 1 if failed else 0


def _explicit_out(args: argparse.Namespace) -> Path | None:
    return Path(args.out) if args.out else None


def _run_one(bench_dir: Path, name: str, quick: bool) -> Section | None:
    script = bench_dir / f"{name}.py"
    if not script.is_file():
        print(f"doccp bench: {script} not found, keeping the saved {name} section", file=sys.stderr)
        return None
    argv = ["--quick"] if quick else []
    with Step(f"bench {name}{' --quick' if quick else ''}"):
        text, ok = run_script(script, argv)
    return Section(name, text, ok)


def _save(results: Path, section: Section, quick: bool) -> None:
    if not section.text.strip():
        return  # a script that failed before printing anything: keep what was saved
    notes = ", quick run" if quick else ""
    notes += "" if section.ok else ", FAILED or interrupted: partial results"
    results.mkdir(parents=True, exist_ok=True)
    stamp = f"<!-- {section.name}: {_now()}, {machine_line()}{notes} -->"
    (results / f"{section.name}.md").write_text(f"{stamp}\n{section.text.strip()}\n")


def _write_page(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.md").write_text(assemble(out / "results"))
    print(f"doccp bench: wrote {out / 'benchmarks.md'}")


def _find_bench_dir(explicit: str | None, required: bool) -> Path | None:
    """--bench-dir, else ./bench, else bench/ of the source checkout this doccp runs from."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_dir():
            raise UsageError(f"no benchmark folder at {explicit!r} (--bench-dir)")
        return path
    checkout = Path(doccp.__file__).resolve().parents[2]  # <checkout>/src/doccp/__init__.py, for a source install
    for candidate in (Path("bench"), checkout / "bench"):
        if any((candidate / f"{name}.py").is_file() for name in SECTIONS):
            return candidate
    if required:
        raise UsageError("the benchmark scripts live in the doccp source repository (its bench/ folder), which "
                         f"this installation (doccp at {Path(doccp.__file__).parent}) does not include: run "
                         "`doccp bench` from a checkout of the repository, or pass --bench-dir DIR")
    return None


def _checkout_docs(bench_dir: Path | None) -> Path | None:
    """docs/ of the checkout that holds ``bench_dir``, when it is one (it has docs/benchmarks.md)."""
    if bench_dir is None:
        return None
    docs = bench_dir.resolve().parent / "docs"
    return docs if (docs / "benchmarks.md").is_file() else None


def _selected(only: str | None) -> list[str]:
    if not only:
        return list(SECTIONS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise UsageError(f"--only must list some of {','.join(SECTIONS)}, got {only!r}")
    return names


def run_script(script: Path, argv: list[str]) -> tuple[str, bool]:
    """Import ``script``, call its ``main(argv)`` and return ``(markdown, ok)``: the markdown
    it printed (or returned, as a string), and whether it succeeded (no exception, exit code
    0). A failing script's traceback goes to stderr; what it printed before is kept.

    The script's folder goes on ``sys.path`` and the module takes its file name, so ranks
    it spawns can import their worker functions (and the scripts can share helpers).
    """
    folder = str(script.parent.resolve())
    sys.path.insert(0, folder)
    buffer, result, ok = io.StringIO(), None, True
    try:
        spec = importlib.util.spec_from_file_location(script.stem, script)
        assert spec is not None and spec.loader is not None
        module = sys.modules[script.stem] = importlib.util.module_from_spec(spec)
        with contextlib.redirect_stdout(buffer):
            spec.loader.exec_module(module)
            result = module.main(argv)
    except SystemExit as e:
        result = e.code
    except Exception:  # a failing benchmark must not lose the others' results
        print(f"doccp bench: {script.name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        ok = False
    finally:
        sys.path.remove(folder)
        sys.modules.pop(script.stem, None)
    if isinstance(result, str):
        return buffer.getvalue() or result, ok
    if result not in (None, 0):
        print(f"doccp bench: {script.name} main({argv}) exited with {result}", file=sys.stderr)
        ok = False
    return buffer.getvalue(), ok


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
        "Reproduce from a checkout of the repository: `make bench` (all; a complete, successful run",
        "updates this page), `doccp bench --quick --out DIR` (a subset in under 5 minutes, written to DIR),",
        "`doccp bench --only cp` (one section; the others are kept from `docs/results/`),",
        "`doccp bench --assemble` (rebuild this page only). The scripts are in `bench/`; each also runs",
        "alone: `python bench/cp.py [--quick]`. GPU results (the CUDA tests, the `cuda` backend against",
        "the kernel it drives, transformers models on a GPU) are on [the GPU page](gpu.md): their",
        "scripts need a CUDA machine, so `doccp bench` does not run them.",
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
