"""Planner benchmark: balance, KV and pieces of every strategy, and the host cost of planning.

Part 1, quality: seeded layouts of every mix in ``doccp.app.workloads`` (pretrain, sft, long,
lognormal, pareto; 131072 tokens) at N in {2, 4, 8, 16, 32, 64}, causal mask. Per mix and N:
the KV the most-loaded rank receives under the minimal exchange (as a fraction of a full
all-gather) for balanced, contiguous and head_tail, next to the lower bound of
:mod:`doccp.plan.bound` (no balanced plan can receive less), pieces, work imbalance, and the
host time of one rank's plan + schedules + indices. On the sft-like mixes, balanced's KV per layout
is also set against the planner's when the planner v2 issue was filed (:data:`FILED_KV`).

Part 2, host cost at scale: one rank's ``plan`` + ``schedule(allgather)`` + ``schedule(ring_kv)``
+ ``indices`` for every strategy at 131k, 1M, 4M and 16M tokens (lognormal mix) and N in
{8, 64, 256, 1024}, and ``stats()``. Everything on one thread (``torch.set_num_threads(1)``):
every rank repeats this host work every batch.

Part 3, small batches: the same host time at 8k and 32k tokens (fine-tuning batches) and N in
{2, 4, 8, 16}, every mix, where planning is bound by per-call overhead rather than width.

Part 4, every mask: the balanced planner's worst imbalance under full, sliding-window and
chunked masks on the same mixes (the targets hold for every mask, not just causal).

Part 2 also times the largest cell (16M tokens, N = 1024) in fresh processes under the allocator
settings of :data:`ALLOCATORS`: at that size host planning is bound by page faults on its fresh
multi-MB tables.

Part 5, memory: the peak RSS growth of a fresh process planning a document of 2**20 and of
2**31 - 1 tokens (the most a layout holds) with every strategy, stats included.

    python bench/plan.py            # full run (the 16M-token rows take a few minutes)
    python bench/plan.py --quick    # 2 layouts per mix, N in {2, 8, 64}; 131k and 1M tokens only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from doccp import DocLayout, Mask, plan
from doccp.algorithms.registry import schedule_of
from doccp.app import workloads
from doccp.plan import STRATEGIES
from doccp.plan.bound import kv_lower_bound

NAMES = ("balanced", "contiguous", "head_tail")
MIXES = tuple(workloads.MIXES)
TOKENS = 131072
WORLD_SIZES = (2, 4, 8, 16, 32, 64)
SCALE_TOKENS = (131072, 1 << 20, 1 << 22, 1 << 24)
SCALE_WORLD = (8, 64, 256, 1024)
SCALE_MIX = "lognormal"
SMALL_TOKENS = (8192, 32768)
SMALL_WORLD = (2, 4, 8, 16)
#: The clock host times are read from: wall time, or with --cpu-time this process's CPU time
#: (one thread, so the same figure on a quiet machine, and robust on a loaded one).
CLOCK = [time.perf_counter]
OTHER_MASKS = (Mask.full(), Mask.sliding_window(256), Mask.chunked(1024))
#: Balanced's max KV (a fraction of an all-gather) on each of the first 8 layouts of the sft-like mixes
#: when the planner v2 issue was filed: the planner at 8f29ccb (reproduce: ``git worktree add
#: /tmp/filed 8f29ccb`` and plan these layouts with ``PYTHONPATH=/tmp/filed/src``). The issue asks for
#: at least half of it on sft-like layouts; layouts where it was 0 are not compared.
FILED = "8f29ccb"
FILED_KV = {
    ("sft", 2): (0.0315, 0.0293, 0.0288, 0.0355, 0.0308, 0.0187, 0.0260, 0.0296),
    ("sft", 4): (0.0309, 0.0293, 0.0288, 0.0691, 0.0308, 0.0187, 0.0261, 0.0296),
    ("sft", 8): (0.0618, 0.0517, 0.0515, 0.0691, 0.0608, 0.0187, 0.0432, 0.0783),
    ("sft", 16): (0.1357, 0.1128, 0.0994, 0.1038, 0.1077, 0.0642, 0.1712, 0.1150),
    ("sft", 32): (0.2094, 0.2014, 0.2170, 0.1987, 0.2208, 0.1509, 0.2526, 0.2402),
    ("sft", 64): (0.3457, 0.3787, 0.3389, 0.3874, 0.3013, 0.2939, 0.3460, 0.3615),
    ("lognormal", 2): (0.0514, 0.0267, 0.0949, 0.0343, 0.0987, 0.0327, 0.0549, 0.0390),
    ("lognormal", 4): (0.1324, 0.0271, 0.1451, 0.0343, 0.0987, 0.0327, 0.1479, 0.0385),
    ("lognormal", 8): (0.1476, 0.0438, 0.1547, 0.0922, 0.0990, 0.0898, 0.1872, 0.1475),
    ("lognormal", 16): (0.1989, 0.1555, 0.2183, 0.1774, 0.0987, 0.1721, 0.2316, 0.1557),
    ("lognormal", 32): (0.2505, 0.2914, 0.4328, 0.3369, 0.2847, 0.2243, 0.2943, 0.2151),
    ("lognormal", 64): (0.5179, 0.4662, 0.5715, 0.5638, 0.4940, 0.4104, 0.6024, 0.4374),
}
#: Allocator settings the largest scaling cell is also timed with, each in a fresh process (they are
#: read when a process starts): PyTorch's 2 MB-aligned CPU allocations advised as transparent huge
#: pages, and glibc keeping freed memory for reuse instead of unmapping it (the setting
#: docs/choosing.md suggests). At that size a rank's host tables are hundreds of MB, and much of the
#: default's time is the kernel handing out fresh zeroed pages for them.
ALLOCATORS = {
    "THP_MEM_ALLOC_ENABLE=1": {"THP_MEM_ALLOC_ENABLE": "1"},
    "MALLOC_MMAP_THRESHOLD_ + MALLOC_TRIM_THRESHOLD_": {"MALLOC_MMAP_THRESHOLD_": "4000000000",
                                                        "MALLOC_TRIM_THRESHOLD_": "100000000000"},
}
#: The cell timed under :data:`ALLOCATORS` (tokens, N) and, per setting, seconds per strategy.
Allocators = tuple[tuple[int, int], dict[str, dict[str, float]]]
#: The scaling cells (the host-time targets) repeat until their timings add up to this many seconds.
SCALE_SECONDS = 1.0
MAX_REPEATS = 20


def one_rank(layout: DocLayout, n: int, strategy: str, rank: int | None = None) -> float:
    """Seconds for what one rank does per batch: plan, both schedules, its indices."""
    rank = n // 2 if rank is None else rank
    start = CLOCK[0]()
    p = plan(layout, n, Mask.causal(), strategy)
    schedule_of("allgather", p, rank)
    schedule_of("ring_kv", p, rank)
    p.indices(rank)
    return CLOCK[0]() - start


def best_of(fn, repeats: int, seconds: float = 0.0) -> float:
    """Least of ``repeats`` timings, and of more while they add up to under ``seconds`` (at most
    :data:`MAX_REPEATS`): on a noisy VM the least of a few runs of a 60 ms cell still varies by
    10-20% from run to run."""
    times = [fn() for _ in range(repeats)]
    while sum(times) < seconds and len(times) < MAX_REPEATS:
        times.append(fn())
    return min(times)


@dataclass
class Cell:
    """One (mix, N): per layout, the stats of every strategy, the bound and balanced's host time."""

    kv: dict[str, list[float]]
    pieces: dict[str, list[int]]
    imbalance: dict[str, list[float]]
    bound: list[float]
    seconds: list[float]


def measure(layouts: list[list[int]], n: int, repeats: int) -> Cell:
    cell = Cell({s: [] for s in NAMES}, {s: [] for s in NAMES}, {s: [] for s in NAMES}, [], [])
    for lengths in layouts:
        layout = DocLayout.from_lengths(lengths)
        for s in NAMES:
            stats = plan(layout, n, Mask.causal(), s).stats()
            cell.kv[s].append(stats.max_kv_fraction)
            cell.pieces[s].append(sum(stats.pieces))
            cell.imbalance[s].append(stats.imbalance)
        allgather = max(layout.num_tokens - layout.num_tokens // n, 1)
        cell.bound.append(kv_lower_bound(layout, n, Mask.causal()) / allgather)
        cell.seconds.append(best_of(lambda layout=layout: one_rank(layout, n, "balanced"), repeats))
    return cell


def scaling(tokens_list, world_sizes, repeats: int) -> dict[tuple[int, int, str], float]:
    times = {}
    for tokens in tokens_list:
        layout = DocLayout.from_lengths(workloads.layout(SCALE_MIX, tokens, 0))
        for n in world_sizes:
            for s in NAMES:
                times[(tokens, n, s)] = best_of(lambda layout=layout, n=n, s=s: one_rank(layout, n, s), repeats,
                                                SCALE_SECONDS)
            times[(tokens, n, "stats")] = best_of(
                lambda layout=layout, n=n: _stats_seconds(layout, n, "head_tail"), repeats, SCALE_SECONDS)
        if tokens == 1 << 20 and 256 not in world_sizes:  # the stats() target
            times[(tokens, 256, "stats")] = best_of(lambda layout=layout: _stats_seconds(layout, 256, "head_tail"),
                                                    repeats, SCALE_SECONDS)
    return times


def with_allocators(tokens: int, n: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per :data:`ALLOCATORS` setting, one rank's host seconds per strategy in the scaling cell
    (tokens, n), timed by a fresh process of this script (``--cell``) with that environment."""
    flags = ["--repeats", str(args.repeats), *(["--cpu-time"] if args.cpu_time else [])]
    out = {}
    for name, env in ALLOCATORS.items():
        run = subprocess.run([sys.executable, __file__, "--cell", str(tokens), str(n), *flags],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True)
        out[name] = json.loads(run.stdout.splitlines()[-1])
    return out


def transparent_huge_pages() -> str:
    """The kernel's THP mode (``always``/``madvise``/``never``; the bracketed one), or ``unknown``."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    chosen = [word for word in text.split() if word.startswith("[")]
    return chosen[0].strip("[]") if chosen else "unknown"


def small_batches(count: int, world_sizes, repeats: int) -> dict[tuple[int, int], dict[str, list[float]]]:
    """Per (tokens, N): one rank's host seconds on every layout of every mix, per strategy."""
    times = {}
    for tokens in SMALL_TOKENS:
        layouts = [DocLayout.from_lengths(lengths)
                   for mix in MIXES for lengths in workloads.layouts(mix, tokens, count)]
        for n in world_sizes:
            times[(tokens, n)] = {s: [best_of(lambda layout=layout, n=n, s=s: one_rank(layout, n, s), repeats)
                                      for layout in layouts] for s in NAMES}
    return times


def other_masks(count: int, world_sizes) -> dict[str, float]:
    """Worst balanced imbalance per mask over every mix, layout and N."""
    worst = {}
    for mask in OTHER_MASKS:
        worst[str(mask)] = max(plan(DocLayout.from_lengths(lengths), n, mask).stats().imbalance
                               for mix in MIXES for lengths in workloads.layouts(mix, TOKENS, count)
                               for n in world_sizes)
    return worst


def _stats_seconds(layout: DocLayout, n: int, strategy: str) -> float:
    p = plan(layout, n, Mask.causal(), strategy)
    start = CLOCK[0]()
    p.stats()
    return CLOCK[0]() - start


# -- report --------------------------------------------------------------------------------
MEMORY_SCRIPT = """
import sys
import torch
from doccp import DocLayout, Mask, plan
torch.set_num_threads(1)


def status(key):  # MB, from /proc (Linux): VmHWM is the peak RSS since the reset below
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024


open("/proc/self/clear_refs", "w").write("5")  # reset the peak: the imports do not count
base = status("VmRSS")
length, n = int(sys.argv[1]), int(sys.argv[2])
for strategy in sys.argv[3:]:
    plan(DocLayout.from_lengths([length - 12, 5, 7]), n, Mask.causal(), strategy).stats()
print(status("VmHWM") - base)
"""
MEMORY_LENGTHS = (1 << 20, (1 << 31) - 1)
MEMORY_WORLD = (8, 1024)


def planning_memory(lengths=MEMORY_LENGTHS, world_sizes=MEMORY_WORLD) -> dict[tuple[int, int], float]:
    """Peak RSS growth (MB) of planning one long document (and two short ones) with every strategy
    and taking its ``stats()``, per (tokens, N), each in a fresh process (Linux)."""
    out = {}
    for tokens in lengths:
        for n in world_sizes:
            run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tokens), str(n), *NAMES],
                                 capture_output=True, text=True, check=True)
            out[(tokens, n)] = float(run.stdout.split()[-1])
    return out


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(cells: dict[tuple[str, int], Cell], times: dict, allocators: Allocators,
           small: dict, masks: dict[str, float], memory: dict[tuple[int, int], float], args: argparse.Namespace) -> str:
    per_mix = len(next(iter(cells.values())).bound)
    out = [
        "## Planner",
        "",
        f"Reproduce: `{args.command}` from the repository root (layouts from `doccp.app.workloads`, "
        f"seeded). Causal mask; {per_mix} layouts of {TOKENS} tokens per mix; every figure is the worst "
        "layout of its mix. Host time on one thread (`torch.set_num_threads(1)`; "
        f"{'CPU' if args.cpu_time else 'wall'} time), best of "
        f"{args.repeats} runs: one rank's `plan` + `schedule(allgather)` + `schedule(ring_kv)` + `indices`.",
        "",
        "### KV, pieces and balance per mix and N",
        "Max KV = the KV tokens the most-loaded rank receives under the minimal exchange, as a fraction of "
        "a full all-gather (T - T/N), on the worst layout; *mean KV balanced* the mean over the layouts. "
        "Bound = `doccp.plan.bound.kv_lower_bound` (no plan with tokens within "
        "one and imbalance <= 1.01 receives less); *ratio* = balanced / bound on the same layout (worst); "
        "*gap* = balanced minus bound on the same layout (worst; a ratio of a bound near 0 says little); "
        "*excess* = balanced's max KV minus contiguous's (unbalanced) on the same layout (worst).",
        "",
    ]
    rows = []
    for (mix, n), c in cells.items():
        ratios = [b / lb for b, lb in zip(c.kv["balanced"], c.bound, strict=True) if lb > 0]
        excess = max(b - k for b, k in zip(c.kv["balanced"], c.kv["contiguous"], strict=True))
        gap = max(b - lb for b, lb in zip(c.kv["balanced"], c.bound, strict=True))
        rows.append([mix, n, *(f"{max(c.kv[s]):.3f}" for s in NAMES), f"{statistics.mean(c.kv['balanced']):.4f}",
                     f"{max(c.bound):.3f}",
                     f"{max(ratios):.2f}" if ratios else "n/a (bound 0)", f"{gap:.3f}", f"{excess:+.3f}",
                     *(f"{statistics.mean(c.pieces[s]):.0f}" for s in NAMES),
                     f"{max(c.imbalance['balanced']):.4f}", f"{max(c.imbalance['contiguous']):.3f}",
                     ms(max(c.seconds))])
    out.append(table(["mix", "N", *(f"max KV {s}" for s in NAMES), "mean KV balanced", "bound", "ratio", "gap",
                      "excess", *(f"pieces {s}" for s in NAMES), "imbalance balanced", "imbalance contiguous",
                      "host ms balanced"], rows))
    out += ["", f"### Host time at scale ({SCALE_MIX} mix, ms)",
            "One rank's plan + schedules + indices per strategy; `stats()` of a head_tail plan (every rank's "
            f"figures) after planning. Best of at least {args.repeats} runs, and of more (up to {MAX_REPEATS}) "
            f"while they add up to under {SCALE_SECONDS:g} s.", ""]
    scale_tokens = sorted({t for t, _, _ in times})
    scale_n = sorted({n for _, n, _ in times})
    rows = [[f"{t:,}", n, *(ms(times[(t, n, s)]) if (t, n, s) in times else "-" for s in (*NAMES, "stats"))]
            for t in scale_tokens for n in scale_n if any((t, n, s) in times for s in (*NAMES, "stats"))]
    out.append(table(["tokens", "N", *NAMES, "stats() head_tail"], rows))
    (tokens, n), settings = allocators
    out += ["", f"Allocator settings, {tokens:,} tokens, N = {n} (ms): the same cells, each setting timed by a fresh "
            "process with it in its environment. `THP_MEM_ALLOC_ENABLE=1`: PyTorch's 2 MB-aligned CPU allocations, "
            f"advised as transparent huge pages (this kernel's THP mode: `{transparent_huge_pages()}`); "
            "`MALLOC_MMAP_THRESHOLD_=4000000000 MALLOC_TRIM_THRESHOLD_=100000000000`: glibc keeps freed memory "
            "for reuse instead of unmapping it. A rank's host tables are tens to hundreds of MB here, and much of "
            "the default's time is page faults on the first touch of each fresh one.", "",
            table(["strategy", "default", *settings],
                  [[s, ms(times[(tokens, n, s)]), *(f"{ms(t[s])} ({times[(tokens, n, s)] / t[s]:.2f}x)"
                                                     for t in settings.values())] for s in NAMES])]
    per_size = len(next(iter(small.values()))["balanced"]) if small else 0
    out += ["", "### Host time on small batches (ms)",
            f"One rank's plan + schedules + indices on {per_size} layouts (every mix) per size: fine-tuning "
            "batches, where planning is bound by the per-call overhead of its vectorised work.", ""]
    rows = [[f"{t:,}", n, ms(statistics.median(c["balanced"])), ms(max(c["balanced"])),
             *(ms(max(c[s])) for s in NAMES[1:])] for (t, n), c in small.items()]
    out.append(table(["tokens", "N", "balanced median", "balanced worst", *(f"{s} worst" for s in NAMES[1:])], rows))
    out += ["", "### Balance under other masks", "Worst max/mean work of `balanced` over every mix, layout and N "
            "above.", "", table(["mask", "worst imbalance"], [[m, f"{v:.4f}"] for m, v in masks.items()])]
    out += ["", "### Memory of planning (MB)",
            "Peak RSS growth (over the RSS after its imports) of a fresh process planning one document of "
            "`tokens` (and two short ones) with every strategy and taking each plan's `stats()`: O(documents + "
            "pieces), not O(tokens) (a table per token would be 16 GB at 2**31 tokens).", "",
            table(["tokens", "N", "peak RSS growth"], [[f"{t:,}", n, f"{mb:.1f}"] for (t, n), mb in memory.items()])]
    out += ["", "### Targets", "", targets(cells, times, allocators, masks, memory)]
    return "\n".join(out)


def targets(cells: dict[tuple[str, int], Cell], times: dict, allocators: Allocators,
            masks: dict[str, float], memory: dict[tuple[int, int], float]) -> str:
    def row(name: str, values: list[float], fmt: str, ok) -> list[str]:
        if not values:
            return [name, "not measured", "n/a"]
        worst = max(values)
        return [name, fmt.format(worst), "PASS" if ok(worst) else "MISS"]

    def every(fn, mixes=MIXES) -> list[float]:
        return [v for (mix, _), c in cells.items() if mix in mixes for v in fn(c)]

    rows = [
        row("balanced imbalance <= 1.01, every mix and N", every(lambda c: c.imbalance["balanced"]), "{:.4f}",
            lambda v: v <= 1.01),
        row("balanced imbalance <= 1.01 under full, sliding-window and chunked masks", list(masks.values()),
            "{:.4f}", lambda v: v <= 1.01),
        row("balanced max KV <= contiguous's + 0.05 of an all-gather (worst excess)",
            every(lambda c: [b - k for b, k in zip(c.kv["balanced"], c.kv["contiguous"], strict=True)]),
            "{:+.3f}", lambda v: v <= 0.05),
        row("balanced max KV <= contiguous's + 0.05, shared mixes (pretrain, sft, long)",
            every(lambda c: [b - k for b, k in zip(c.kv["balanced"], c.kv["contiguous"], strict=True)],
                  workloads.SHARED_MIXES), "{:+.3f}", lambda v: v <= 0.05),
        row("the same, on layouts where the bound allows it (bound <= contiguous's + 0.05)",
            every(lambda c: [b - k for b, k, lb in zip(c.kv["balanced"], c.kv["contiguous"], c.bound, strict=True)
                             if lb <= k + 0.05]), "{:+.3f}", lambda v: v <= 0.05),
        *(row(f"balanced max KV <= half the planner's when the issue was filed ({FILED}), {mix} mix, every "
              f"layout and N{where} (worst ratio)", filed_ratios(cells, mix, bounded), "{:.2f}", lambda v: v <= 0.5)
          for mix in sorted({m for m, _ in FILED_KV})
          for bounded, where in ((False, ""), (True, " where the bound allows it (bound <= half of it)"))),
        row("balanced max KV within 1.2x of the lower bound (where the bound > 0)",
            every(lambda c: [b / lb for b, lb in zip(c.kv["balanced"], c.bound, strict=True) if lb > 0]),
            "{:.2f}", lambda v: v <= 1.2),
    ]
    for s in NAMES:
        rows.append(row(f"{s}: one rank's plan + schedules + indices <= 50 ms at 1M tokens, N = 64 (ms)",
                        [1e3 * t for (tok, n, name), t in times.items() if (tok, n, name) == (1 << 20, 64, s)],
                        "{:.1f}", lambda v: v <= 50))
        rows.append(row(f"{s}: the same <= 2 s at 16M tokens, N = 1024 (s)",
                        [t for (tok, n, name), t in times.items() if (tok, n, name) == (1 << 24, 1024, s)],
                        "{:.2f}", lambda v: v <= 2))
        rows.append(row(f"{s}: the same with the better allocator setting above (s)",
                        [min(t[s] for t in allocators[1].values())] if allocators[0] == (1 << 24, 1024) else [],
                        "{:.2f}", lambda v: v <= 2))
    rows.append(row("stats() <= 1 s at 1M tokens, N = 256 (s)",
                    [t for (tok, n, name), t in times.items() if (tok, n, name) == (1 << 20, 256, "stats")],
                    "{:.2f}", lambda v: v <= 1))
    short, long = ([mb for (t, _), mb in memory.items() if t == tokens] for tokens in MEMORY_LENGTHS)
    flat = max(long) <= max(short) + 64
    rows.append(["planning memory O(documents + pieces): peak RSS growth at 2**31 tokens vs 2**20 (MB)",
                 f"{max(long):.0f} vs {max(short):.0f}", "PASS" if flat else "MISS"])
    readme = plan(DocLayout.from_lengths([300, 40, 1000, 7, 700]), 4)
    whole = all(sum(1 for r in range(4) for d, _, _ in readme.pieces(r) if d == doc) == 1 for doc in (0, 1, 3))
    rows.append(["README example keeps its 300-, 40- and 7-token documents whole",
                 "yes" if whole else "no", "PASS" if whole else "MISS"])
    return table(["target", "measured", "status"], rows)


def filed_ratios(cells: dict[tuple[str, int], Cell], mix: str, bounded: bool = False) -> list[float]:
    """Balanced's max KV over the planner's when the issue was filed (:data:`FILED_KV`), per layout
    of ``mix`` and N; with ``bounded``, only where the lower bound leaves room for half of it."""
    return [b / old for (m, n), c in cells.items() if m == mix
            for b, old, lb in zip(c.kv["balanced"], FILED_KV.get((m, n), ()), c.bound,
                                  strict=False)  # a quick run: its first layouts
            if old > 0 and not (bounded and lb > old / 2)]


def cell(args: argparse.Namespace) -> int:
    """``--cell TOKENS N``: print one rank's host seconds per strategy on the scaling layout (JSON)."""
    tokens, n = args.cell
    torch.set_num_threads(1)
    layout = DocLayout.from_lengths(workloads.layout(SCALE_MIX, tokens, 0))
    seconds = {s: best_of(lambda s=s: one_rank(layout, n, s), args.repeats, SCALE_SECONDS) for s in NAMES}
    print(json.dumps(seconds))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layouts per mix, N in {2, 8, 64}, up to 1M tokens")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (default 3, quick 1)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with this process's CPU time (for a loaded machine) instead of wall time")
    parser.add_argument("--cell", type=int, nargs=2, metavar=("TOKENS", "N"),
                        help="only time one scaling cell, print JSON (the allocator settings' fresh processes)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    CLOCK[0] = time.process_time if args.cpu_time else time.perf_counter
    if args.cell:
        return cell(args)
    flags = [f for f, on in (("--quick", args.quick), ("--cpu-time", args.cpu_time)) if on]
    args.command = " ".join(["python bench/plan.py", *flags])
    assert set(NAMES) == set(STRATEGIES), "bench/plan.py lists every strategy"
    count, world_sizes = (2, (2, 8, 64)) if args.quick else (8, WORLD_SIZES)
    scale_tokens = SCALE_TOKENS[:2] if args.quick else SCALE_TOKENS
    scale_world = (8, 64) if args.quick else SCALE_WORLD

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cells = {(mix, n): measure(workloads.layouts(mix, TOKENS, count), n, args.repeats)
                 for mix in MIXES for n in world_sizes}
        times = scaling(scale_tokens, scale_world, args.repeats)
        biggest = (max(scale_tokens), max(scale_world))
        allocators = (biggest, with_allocators(*biggest, args))
        small = small_batches(count // 2, (2, 8) if args.quick else SMALL_WORLD, args.repeats)
        masks = other_masks(1 if args.quick else count // 2, (3, 8) if args.quick else WORLD_SIZES)
    finally:
        torch.set_num_threads(threads)
    memory = planning_memory()
    print(report(cells, times, allocators, small, masks, memory, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
