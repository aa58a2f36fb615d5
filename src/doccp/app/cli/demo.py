"""Run doccp end to end on a real corpus and check that CP is exact.

Steps: (1) pack a batch of byte tokens from a folder of text files (default: this Python's
standard library), (2) plan it with every strategy and draw the plans, (3) run a tiny
LLaMA-style model forward + backward on --world-size gloo ranks with every CP algorithm and
compare logits, loss and gradients with one process, (4) prefill every document under CP
(pass-KV and pass-Q), decode a few tokens greedily and check them with one process. Exits 1
if a CP result differs from one process beyond the tolerance, 2 on bad input.

On GPUs, one process per rank: torchrun --nproc-per-node N -m doccp.app.demo --backend nccl
"""

from __future__ import annotations

import argparse
import os
import queue
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import doccp
from doccp import launch
from doccp.algorithms.registry import training
from doccp.app import demo
from doccp.app.cli.main import UsageError
from doccp.app.cli.progress import Step
from doccp.app.corpus import Batch, pack, scan, stdlib_dir
from doccp.layout import MAX_TOKENS
from doccp.masks import Mask
from doccp.plan import STRATEGIES

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--corpus", metavar="DIR", help="folder of text files to read (default: the standard library "
                   "of the running Python, *.py files)")
    p.add_argument("--pattern", metavar="GLOB", help="file name pattern inside the corpus, searched recursively "
                   "(default: *.py for the standard library, * for --corpus)")
    p.add_argument("--tokens", type=int, default=32768, metavar="N",
                   help="tokens (bytes) in the packed batch (default: %(default)s)")
    p.add_argument("--max-doc-len", type=int, default=2048, metavar="N",
                   help="files longer than this are split into several documents (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed for the file order and the model weights (default: 0)")
    p.add_argument("--world-size", type=int, default=4, metavar="N",
                   help="CP ranks to spawn (default: %(default)s; under torchrun its WORLD_SIZE is used)")
    p.add_argument("--mask", default="causal", metavar="MASK",
                   help="attention mask: causal, full, window:LEFT[,RIGHT] or chunked:SIZE (default: %(default)s)")
    p.add_argument("--strategy", default="balanced", choices=sorted(STRATEGIES),
                   help="plan used for the model runs; the table shows all (default: %(default)s)")
    p.add_argument("--algorithms", metavar="LIST",
                   help=f"CP algorithms to check, comma-separated, of {', '.join(training())} (default: every one "
                   "that can run the model at the world size; the hybrid runs on Ulysses groups of a proper factor "
                   "of it, e.g. 2 x 2 at 4 ranks)")
    p.add_argument("--decode-tokens", type=int, default=8, metavar="N",
                   help="tokens to generate per document after the CP prefill; 0 skips step 4 (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="model dtype: float32 (tolerance 1e-4) or float64 (1e-10) (default: %(default)s)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                   help="torch.distributed backend; nccl needs torchrun and GPUs (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch threads per rank (default: cores / world size; under torchrun, its OMP_NUM_THREADS)")
    p.add_argument("--out", default="doccp-demo", metavar="DIR",
                   help="folder for the plan pictures and report.md (default: ./%(default)s)")


@dataclass
class Options:
    corpus: Path
    pattern: str
    mask: Mask
    algorithms: tuple[str, ...]
    dtype: torch.dtype
    out: Path


def _options(args: argparse.Namespace) -> Options:
    """Validate the flags (every problem is one line and exit code 2)."""
    for flag, minimum, maximum in (("tokens", 1, MAX_TOKENS), ("max_doc_len", 1, MAX_TOKENS),
                                   ("world_size", 1, 1 << 12), ("decode_tokens", 0, 1 << 16), ("threads", 0, 1 << 12)):
        value = getattr(args, flag)
        if not minimum <= value <= maximum:
            raise UsageError(f"--{flag.replace('_', '-')} must be in [{minimum}, {maximum}], got {value}")
    if args.tokens < args.world_size:
        raise UsageError(f"--tokens ({args.tokens}) must be at least --world-size ({args.world_size}): "
                         "every rank needs a token")
    if args.algorithms is None:
        algorithms = tuple(a for a in training() if demo.unavailable(a, args.world_size) is None)
    else:
        algorithms = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
        if not algorithms or any(a not in training() for a in algorithms):
            raise UsageError(f"--algorithms must list some of {', '.join(training())}, got {args.algorithms!r}")
        for a in algorithms:
            if (why := demo.unavailable(a, args.world_size)) is not None:
                raise UsageError(f"--algorithms: {a} cannot run the demo's model on {args.world_size} ranks: {why}")
    try:
        mask = Mask.parse(args.mask)
    except ValueError as e:
        raise UsageError(str(e)) from None
    corpus = Path(args.corpus) if args.corpus else stdlib_dir()
    pattern = args.pattern or ("*" if args.corpus else "*.py")
    return Options(corpus, pattern, mask, algorithms, DTYPES[args.dtype], Path(args.out))


@dataclass
class Report:
    """Prints the report as it grows (rank 0 only) and keeps it for ``report.md``."""

    lines: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (topic, one line) for the summary

    def __call__(self, text: str = "") -> None:
        self.lines.append(text)
        print(text, flush=True)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    torchrun = demo.launched_by_torchrun()
    if torchrun:  # one process per rank: the launcher sets the world size
        args.world_size = int(os.environ["WORLD_SIZE"])
    opts = _options(args)
    if args.backend == "nccl" and not torchrun:
        raise UsageError("--backend nccl needs one process per GPU: torchrun --nproc-per-node N -m doccp.app.demo "
                         "--backend nccl")
    rank, device = _init_torchrun(args.backend, args.threads) if torchrun else (0, torch.device("cpu"))
    report = Report()
    try:
        with Step("reading the corpus", enabled=rank == 0):
            batch = pack(scan(opts.corpus, opts.pattern), args.tokens, args.max_doc_len, args.seed)
        if batch.layout.num_tokens < args.world_size:
            raise UsageError(f"the corpus holds only {batch.layout.num_tokens} tokens, fewer than the "
                             f"{args.world_size} ranks")
        work = demo.Workload(batch.tokens, batch.layout.cu_seqlens, opts.mask, args.strategy, opts.algorithms,
                             opts.dtype, args.seed, args.decode_tokens)
        if rank == 0:
            _describe(report, batch, opts, args)
            _plans(report, batch, opts, args.world_size)
        results = _cp_runs(work, args, rank, device, torchrun)
        if rank == 0:
            runs, generations = demo.assemble(work.plan(args.world_size), results)
            _training(report, work, runs, device)
            _generation(report, work, generations, device)
            _summary(report, opts, time.perf_counter() - start)
    finally:
        if torchrun:
            dist.destroy_process_group()
    return 1 if report.failed else 0


def _init_torchrun(backend: str, threads: int) -> tuple[int, torch.device]:
    """One process per rank, rendezvous from torchrun's environment."""
    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(minutes=10))
    return dist.get_rank(), device


def _describe(report: Report, batch: Batch, opts: Options, args: argparse.Namespace) -> None:
    lengths = batch.layout.lengths
    report(f"# doccp demo\n\n{batch.layout.num_tokens} byte tokens in {batch.layout.num_docs} documents "
           f"(lengths {int(lengths.min())}..{int(lengths.max())}, median {int(lengths.median())}) from "
           f"{batch.num_files} files of {opts.corpus} (pattern {opts.pattern!r}, seed {args.seed}); "
           f"{args.world_size} CP ranks, {opts.mask} mask.")
    if batch.layout.num_tokens < args.tokens:
        report(f"(the corpus holds only {batch.layout.num_tokens} tokens, fewer than --tokens {args.tokens})")


def _plans(report: Report, batch: Batch, opts: Options, world_size: int) -> None:
    with Step("planning", total=len(STRATEGIES)) as step:  # progress lines go between sections, never inside
        plans = {}
        for name in STRATEGIES:
            plans[name] = doccp.plan(batch.layout, world_size, opts.mask, name)
            step.advance()
        stats = {name: p.stats() for name, p in plans.items()}
    report("\n## 1. Plans: who holds which tokens\n")
    report("| strategy | work imbalance (max/mean) | pieces (max per rank) | max KV received | vs all-gather |")
    report("|---|---|---|---|---|")
    for name, s in stats.items():
        report(f"| {name} | {s.imbalance:.3f} | {max(s.pieces)} | {max(s.kv_recv)} tokens | {s.max_kv_fraction:.1%} |")
    for name, s in stats.items():
        report(f"\n{name}, per rank:\n```\n{s.table()}\n```")
    best = stats["balanced"]
    others = "; ".join(f"{n}: {s.imbalance:.3f}, {_count(max(s.pieces), 'piece')}, {s.max_kv_fraction:.0%}"
                       for n, s in stats.items() if n != "balanced")
    report.notes.append(("plans", f"balanced: work imbalance {best.imbalance:.3f}, at most "
                                  f"{_count(max(best.pieces), 'piece')} per rank, KV received "
                                  f"{best.max_kv_fraction:.0%} of an all-gather ({others})"))
    try:
        from doccp.app.plot import plot_plan

        opts.out.mkdir(parents=True, exist_ok=True)
        with Step("drawing the plans", total=len(plans)) as step:
            paths = []
            for name, p in plans.items():
                paths.append(str(plot_plan(p, opts.out / f"plan-{name}.png")))
                step.advance()
    except ImportError as e:  # matplotlib is optional
        report(f"\n(plan pictures skipped: {e}; pip install 'doccp[plot]')")
        report.notes.append(("pictures", "skipped: matplotlib is not installed"))
        return
    report("\nPictures (document mask coloured by rank, work per rank): " + ", ".join(paths))
    report.notes.append(("pictures", ", ".join(paths)))


class _Ticks:
    """Progress from spawned rank 0 to this process (picklable at spawn time)."""

    def __init__(self) -> None:
        self.queue = launch.context().Queue()

    def __call__(self) -> None:
        self.queue.put(1)

    def poll(self) -> int:
        count = 0
        while True:
            try:
                count += self.queue.get_nowait()
            except queue.Empty:
                return count


def _cp_runs(work: demo.Workload, args: argparse.Namespace, rank: int, device: torch.device,
             torchrun: bool) -> list[dict] | None:
    """Every rank's :func:`doccp.app.demo.cp_rank` results (on the reporting rank; None elsewhere)."""
    steps = len(work.algorithms) + (len(demo.PREFILL) if work.generates else 0)
    label = (f"CP on {args.world_size} {args.backend} ranks: forward+backward ({', '.join(work.algorithms)})"
             + (f", prefill+decode ({', '.join(demo.PREFILL)})" if work.generates else ""))
    if torchrun:
        with Step(label, total=steps, enabled=rank == 0) as step:
            mine = demo.cp_rank(rank, work, step.advance, device=device)
        gathered = [None] * args.world_size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return gathered
    ticks = _Ticks()
    with Step(label, total=steps, poll=ticks.poll):
        return launch.spawn(demo.cp_rank, args.world_size, work, ticks, threads=args.threads or None)


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _per_rank(values: list[float], fmt: str = "{:.2f}") -> str:
    return " ".join(fmt.format(v) for v in values)


def _mb(values: list[int]) -> str:
    return _per_rank([v / 2**20 for v in values], "{:.1f}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("s" if n != 1 else "")


def _training(report: Report, work: demo.Workload, runs: list[demo.Run], device: torch.device) -> None:
    with Step("one-process reference"):
        ref = demo.single_process(work, device)
    report(f"\n## 2. Tiny LM forward + backward: {len(runs[0].seconds)} CP ranks vs one process\n")
    tol = demo.TOLERANCE[work.dtype]
    report(f"model: {demo.MODEL}, {str(work.dtype).removeprefix('torch.')}, {work.strategy} plan; errors are "
           f"max |CP - 1 process| / max |1 process| (tolerance {tol:.0e})\n")
    report(_row("run", "loss", "logits error", "loss error", "grad error", "time per rank (s)", "MB received per rank"))
    report(_row(*["---"] * 7))
    report(_row("1 process", f"{ref.loss:.6f}", "", "", "", f"{ref.seconds[0]:.2f}", ""))
    bad = []
    for r in runs:
        e = demo.compare(ref, r)
        bad += [r.name] if e.worst() > tol else []
        report(_row(r.name + (" **FAIL**" if e.worst() > tol else ""), f"{r.loss:.6f}", f"{e.logits:.1e}",
                    f"{e.loss:.1e}", f"{e.grads:.1e}", _per_rank(r.seconds), _mb(r.received)))
    if bad:
        report.failed.append(f"training: {', '.join(bad)} differ from one process beyond {tol:.0e}")
        return
    fastest = min(runs, key=lambda r: max(r.seconds))
    report.notes.append(("training", f"{', '.join(r.name for r in runs)} match one process within {tol:.0e} "
                                     "(logits, loss, parameter gradients)"))
    report.notes.append(("time", f"{fastest.name}: slowest rank {max(fastest.seconds):.2f}s ({len(runs[0].seconds)} "
                                 f"ranks x {_count(fastest.threads, 'thread')}) vs one process {ref.seconds[0]:.2f}s "
                                 f"({_count(ref.threads, 'thread')}), on {os.cpu_count()} cores"))


def _generation(report: Report, work: demo.Workload, generations: list[demo.Generation], device: torch.device) -> None:
    title = "\n## 3. Prefill + greedy decode under CP vs one process\n"
    if not generations:
        report(title)
        report("skipped: " + ("--decode-tokens 0" if work.decode_tokens == 0 else
                              f"generation needs a mask that never looks ahead, not {work.mask}"))
        return
    steps = work.decode_tokens
    tol = demo.TOLERANCE[work.dtype]
    with Step("one-process check of the generated tokens", total=len(generations)) as step:
        checks = []
        for g in generations:
            checks.append(demo.check_generation(work, g, device))
            step.advance()
    report(title)
    report(f"Every document is a prompt: prefill with each algorithm, then {steps - 1} decode steps; one process "
           f"re-runs prompts + generated tokens in one forward (tolerance {tol:.0e} on the logits).\n")
    report(_row("prefill", "tokens match", "logits error", "prefill s per rank", f"decode s per rank ({steps - 1} "
                "steps)", "MB received per rank"))
    report(_row(*["---"] * 6))
    bad = []
    for g, (error, same) in zip(generations, checks, strict=True):
        ok = same and error <= tol
        bad += [] if ok else [g.name]
        report(_row(g.name + ("" if ok else " **FAIL**"), "yes" if same else "NO", f"{error:.1e}",
                    _per_rank(g.prefill_seconds), _per_rank(g.decode_seconds), _mb(g.received)))
    sample = generations[0].tokens[0].tolist()
    report(f"\ndocument 0 continues with bytes {sample} ({bytes(sample)!r}; random weights)")
    if bad:
        report.failed.append(f"generation: {', '.join(bad)} differ from one process")
    else:
        report.notes.append(("inference", f"prefill ({', '.join(g.name for g in generations)}) + {steps - 1} decode "
                                          f"steps generate the same {steps} tokens per document as one process"))


def _summary(report: Report, opts: Options, seconds: float) -> None:
    report("\n## Summary\n")
    for what in report.failed:
        report(f"- FAIL: {what}")
    for topic, text in report.notes:
        report(f"- {topic}: {text}")
    path = opts.out / "report.md"
    report(f"- report: {path}")
    report(f"\n{'FAIL' if report.failed else 'PASS'} in {seconds:.1f}s")
    opts.out.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(report.lines) + "\n")
