"""Kernel benchmark: ``varlen_attention`` on the ``cpu`` backend, side by side with
(a) a Python loop calling ``scaled_dot_product_attention`` once per document and
(b) one dense ``scaled_dot_product_attention`` over the whole stream with a boolean
document mask. Prints a markdown section to stdout.

    python bench/kernels.py            # full run (about an hour on 2 cores: mostly (a) on the long mix)
    python bench/kernels.py --quick    # a small subset, under a minute

Ctrl-C (SIGINT) stops a run early and still prints the report of the cases measured so far (exit code 130).

Workload: the first four layouts of every shared mix (``doccp.app.workloads``, 131072 tokens), cropped
to the first 16384 and 32768 tokens; H=8, Hkv in {8, 2}, D=64, fp32; causal and
sliding_window(1024); forward and forward+backward; median of repeats, the contenders
interleaved so that machine noise hits them alike (cases slower than ``--slow`` seconds:
one run each). Plus 4096 documents of 1..16 tokens. Every timed run is a
``torch.utils.benchmark.Timer`` measurement: an untimed warm-up run of the same contender
right before it, the thread count pinned, accelerators synchronised.
Both baselines are pinned to PyTorch's flash kernel (the one SDPA picks on CPU anyway), so
a fallback to the math kernel can never blow up memory.
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: on a shared machine, spinning OpenMP threads make every small
# parallel op wait for a scheduler tick (measured 4x slowdowns under load). Both contenders alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.benchmark import Timer

from doccp import DocLayout, Mask
from doccp.app import workloads
from doccp.varlen import varlen_attention

HEADS, DIM = 8, 64
MASKS = {"causal": Mask.causal(), "window(1024)": Mask.sliding_window(1024)}
TARGET_LOOP, TARGET_DENSE = 0.95, 5.0
NOTES = """### Reading the numbers

- Causal: the cpu backend and (a) run the same kernel call per document (the backend adds only
  host bookkeeping, well under 1% here, and batches equal lengths), so the ratio is 1 up to noise.
  On this shared 2-core machine one run varies by 10-30% with other users' load; a 20-round A/B
  with alternating order on sft gave 1.02 (fwd) and 1.03 (fwd+bwd).
- Sliding window: (a) can only hand a long document's band to SDPA as a dense mask and pays for the
  whole square; the backend computes 256-row blocks against their 1280-key windows, batched.
- Tiny documents: one kernel call per distinct length (16 here) instead of one per document.
  What remains is the kernel's own cost, about 0.4-0.5 us per token and head at these lengths
  however the documents are batched (batched matmul softmax measured 1-3x slower; 64-token blocks
  cost the kernel as much per token and head, so packing documents into masked tiles would not
  help), plus gathering equal-length documents together. The loop's cost per document grows with
  the count (about 50 us per document at 512 documents, about 150 us at 4096 in these runs), so
  the ratio does too: about 1.5-1.8x at 512 documents (`--quick`), 4-6x at 4096."""


# -- contenders ------------------------------------------------------------------------------
def band(length: int, mask: Mask) -> torch.Tensor:
    d = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    return (d >= -mask.left_bound) & (d <= mask.right_bound)


def per_doc_loop(q, k, v, lengths: list[int], mask: Mask) -> torch.Tensor:
    """(a): what one writes without a varlen kernel: split, SDPA per document, concatenate.
    A document within the window is plain causal; a longer one gets its band as a mask."""
    outs = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for qd, kd, vd in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            n = qd.shape[0]
            qd, kd, vd = (x.transpose(0, 1).unsqueeze(0) for x in (qd, kd, vd))
            if mask.is_causal or n <= mask.left_bound + 1:
                o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=band(n, mask), enable_gqa=True)
            outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def dense_masked(q, k, v, doc_mask: torch.Tensor) -> torch.Tensor:
    """(b): one SDPA call over the whole stream with a [T, T] boolean document mask."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                                           attn_mask=doc_mask, enable_gqa=True)
    return o[0].transpose(0, 1)


def doc_mask(layout: DocLayout, mask: Mask) -> torch.Tensor:
    ids, pos = layout.doc_ids(), layout.positions()
    d = pos[None, :] - pos[:, None]
    return (ids[:, None] == ids[None, :]) & (d >= -mask.left_bound) & (d <= mask.right_bound)


# -- timing ----------------------------------------------------------------------------------
def timer(fn: Callable[[], torch.Tensor], leaves, dout, backward: bool, name: str) -> Timer:
    """A Timer for one contender: forward (no autograd graph) or forward + backward, with the
    gradients of ``leaves`` cleared before every measurement (untimed)."""
    def step() -> None:
        if backward:
            fn().backward(dout)
        else:
            with torch.no_grad():
                fn()

    def reset() -> None:
        for x in leaves:
            x.grad = None

    return Timer("step()", setup="reset()", globals={"step": step, "reset": reset},
                 num_threads=torch.get_num_threads(), description=name)


def time_side_by_side(fns: dict[str, Callable[[], torch.Tensor]], leaves, dout, backward: bool,
                      repeats: int, slow_s: float) -> dict[str, float]:
    """Median milliseconds per contender over ``repeats`` interleaved rounds (the order flips
    every round, so drifting machine load hits both alike). In a round each contender gets
    one ``blocked_autorange(min_run_time=0)``: a warm-up run, then one timed run. A case
    where a timed run takes over ``slow_s`` seconds stops after the first round (at that size
    the run is the measurement, and more runs would take hours)."""
    timers = {name: timer(fn, leaves, dout, backward, name) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats):
        for name, t in list(timers.items())[:: 1 if round_ % 2 else -1]:
            times[name].append(t.blocked_autorange(min_run_time=0).median)
        if round_ == 0 and max(ts[0] for ts in times.values()) > slow_s:
            break
    runs = len(next(iter(times.values())))
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()} | {"runs": runs}


def inputs(tokens: int, hkv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS, DIM, generator=gen).requires_grad_()
    k, v = (torch.randn(tokens, hkv, DIM, generator=gen).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(tokens, HEADS, DIM, generator=gen)


def crop(lengths: list[int], tokens: int) -> list[int]:
    out, total = [], 0
    for n in lengths:
        if total == tokens:
            break
        out.append(min(n, tokens - total))
        total += out[-1]
    return out


# -- the runs --------------------------------------------------------------------------------
def bench_mixes(mixes: dict, crops: list[int], layouts: int, hkvs: list[int], masks: dict[str, Mask], repeats: int,
                slow_s: float, dense_tokens: int | None, log, rows: list[dict], dense_rows: list[dict]) -> None:
    """Appends to ``rows`` / ``dense_rows`` as it goes (an interrupted run keeps what it has)."""
    for mix, all_layouts in mixes.items():
        for index, full in enumerate(all_layouts[:layouts]):
            for tokens in crops:
                lengths = crop(full, tokens)
                layout = DocLayout.from_lengths(lengths)
                for hkv in hkvs:
                    q, k, v, dout = inputs(tokens, hkv)
                    for mask_name, mask in masks.items():
                        fns = {"cpu": lambda q=q, k=k, v=v, layout=layout, mask=mask: varlen_attention(
                                   q, k, v, layout, mask, backend="cpu"),
                               "loop": lambda q=q, k=k, v=v, lengths=lengths, mask=mask: per_doc_loop(
                                   q, k, v, lengths, mask)}
                        for backward in (False, True):
                            ms = time_side_by_side(fns, (q, k, v), dout, backward, repeats, slow_s)
                            rows.append(dict(mix=mix, layout=index, tokens=tokens, docs=len(lengths), hkv=hkv,
                                             mask=mask_name, pass_="fwd+bwd" if backward else "fwd", **ms))
                            log(f"{mix}[{index}] {tokens} hkv={hkv} {mask_name} {rows[-1]['pass_']}: "
                                f"cpu {ms['cpu']:.1f} ms, loop {ms['loop']:.1f} ms")
                        if index == 0 and tokens == dense_tokens and hkv == hkvs[0]:
                            dense_rows += bench_dense(mix, layout, mask_name, mask, q, k, v, dout, rows[-2:], log)


def bench_dense(mix, layout, mask_name, mask, q, k, v, dout, cpu_rows: list[dict], log) -> list[dict]:
    """(b) is slow (the whole [T, T] square) and layout-blind: one run per case, against the
    cpu backend's median on the same case (``cpu_rows``: its fwd and fwd+bwd rows)."""
    full_mask = doc_mask(layout, mask)
    out = []
    for backward, cpu_row in zip((False, True), cpu_rows, strict=True):
        dense_timer = timer(lambda: dense_masked(q, k, v, full_mask), (q, k, v), dout, backward, "dense")
        dense = 1e3 * dense_timer.blocked_autorange(min_run_time=0).median
        out.append(dict(mix=mix, tokens=layout.num_tokens, docs=layout.num_docs, hkv=k.shape[1], mask=mask_name,
                        pass_=cpu_row["pass_"], cpu=cpu_row["cpu"], dense=dense))
        log(f"dense {mix} {mask_name} {cpu_row['pass_']}: cpu {cpu_row['cpu']:.1f} ms, dense {dense:.1f} ms")
    return out


def bench_tiny(num_docs: int, hkvs: list[int], repeats: int, slow_s: float, log) -> list[dict]:
    rng = random.Random(0)
    lengths = [rng.randint(1, 16) for _ in range(num_docs)]
    layout = DocLayout.from_lengths(lengths)
    rows = []
    for hkv in hkvs:
        q, k, v, dout = inputs(layout.num_tokens, hkv)
        fns = {"cpu": lambda q=q, k=k, v=v: varlen_attention(q, k, v, layout, backend="cpu"),
               "loop": lambda q=q, k=k, v=v: per_doc_loop(q, k, v, lengths, Mask.causal())}
        for backward in (False, True):
            ms = time_side_by_side(fns, (q, k, v), dout, backward, repeats, slow_s)
            rows.append(dict(docs=num_docs, tokens=layout.num_tokens, hkv=hkv,
                             pass_="fwd+bwd" if backward else "fwd", **ms))
            log(f"tiny {num_docs} hkv={hkv} {rows[-1]['pass_']}: cpu {ms['cpu']:.1f} ms, loop {ms['loop']:.1f} ms")
    return rows


# -- report ----------------------------------------------------------------------------------
def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def cells(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows grouped per (mix, tokens, hkv, mask, pass), over the layouts."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["mix"], r["tokens"], r["hkv"], r["mask"], r["pass_"]), []).append(r)
    return out


def report(args, rows, dense_rows, tiny_rows, minutes: float, interrupted: bool = False) -> str:
    command = " ".join(["python bench/kernels.py", *args.argv])
    parts = [
        "## Kernels",
        "",
        f"Reproduce: `{command}` ({minutes:.0f} min on this machine"
        + ("; the quick subset, not the full benchmark" if args.quick else "")
        + ("; **interrupted**: the tables hold the cases measured before it stopped" if interrupted else "") + ").",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
        f" ({torch.backends.cpu.get_cpu_capability()}), H={HEADS}, D={DIM}, fp32, median of {args.repeats} "
        f"interleaved runs after a warm-up, or a single run where one takes over {args.slow:g} s (column runs). "
        "Speed ratio = baseline time / cpu time (higher is better).",
        "",
        "(a) = Python loop of `scaled_dot_product_attention` per document (split, SDPA, cat; a document longer",
        "than the window gets its band as a boolean mask). (b) = one dense SDPA over the stream with a [T, T]",
        "boolean document mask. Both baselines run PyTorch's CPU flash kernel, like the cpu backend.",
        "",
        f"### cpu backend vs (a), per mix (first {args.layouts} layouts, times summed over them)",
        "",
    ]
    body, worst = [], []
    for (mix, tokens, hkv, mask, pass_), group in cells(rows).items():
        cpu_ms, loop_ms = sum(r["cpu"] for r in group), sum(r["loop"] for r in group)
        lowest = min(r["loop"] / r["cpu"] for r in group)
        worst.append((loop_ms / cpu_ms, lowest, mix, tokens, hkv, mask, pass_))
        runs = sorted({r["runs"] for r in group})
        body.append([mix, tokens, hkv, mask, pass_, "-".join(map(str, runs)), f"{cpu_ms:.0f}", f"{loop_ms:.0f}",
                     f"**{loop_ms / cpu_ms:.2f}**", f"{lowest:.2f}"])
    header = ["mix", "tokens", "Hkv", "mask", "pass", "runs", "cpu ms", "(a) ms", "(a)/cpu", "worst layout"]
    parts += [table(header, body), ""]

    if dense_rows:
        parts += [f"### cpu backend vs (b) dense, first layout of each mix at {dense_rows[0]['tokens']} tokens "
                  f"(Hkv={dense_rows[0]['hkv']}; (b) takes seconds to minutes: one run, against the cpu "
                  "backend's median above)", ""]
        parts += [table(["mix", "docs", "mask", "pass", "cpu ms", "(b) ms", "(b)/cpu"],
                        [[r["mix"], r["docs"], r["mask"], r["pass_"], f"{r['cpu']:.0f}", f"{r['dense']:.0f}",
                          f"**{r['dense'] / r['cpu']:.1f}**"] for r in dense_rows]), ""]
        if not args.quick:
            parts += ["(b) is not run at 32768 tokens: its [T, T] mask alone is 1 GiB as bool and 4 GiB once SDPA "
                      "turns it into an additive float mask, and its cost grows with T^2 while the cpu backend's "
                      "grows with the documents, so its ratio there can only be larger.", ""]
    if tiny_rows:
        parts += [f"### {tiny_rows[0]['docs']} documents of 1..16 tokens ({tiny_rows[0]['tokens']} tokens, causal)",
                  "", table(["Hkv", "pass", "cpu ms", "(a) ms", "(a)/cpu"],
                            [[r["hkv"], r["pass_"], f"{r['cpu']:.1f}", f"{r['loop']:.1f}",
                              f"**{r['loop'] / r['cpu']:.1f}**"] for r in tiny_rows]), ""]

    parts += ["### Targets", ""]
    if worst:
        low = min(worst)
        verdict = "met" if low[0] >= TARGET_LOOP else "**missed**"
        parts.append(f"- cpu >= {TARGET_LOOP}x the speed of (a) on every mix, fwd and fwd+bwd: {verdict} "
                     f"(lowest per-mix ratio {low[0]:.2f} at {low[2]} {low[3]} Hkv={low[4]} {low[5]} {low[6]}; "
                     f"lowest single layout {min(w[1] for w in worst):.2f}).")
    if dense_rows:
        focus = [r for r in dense_rows if r["mix"] in ("pretrain", "sft")]
        if focus:
            low = min(focus, key=lambda r: r["dense"] / r["cpu"])
            verdict = "met" if low["dense"] / low["cpu"] >= TARGET_DENSE else "**missed**"
            parts.append(f"- cpu >= {TARGET_DENSE:.0f}x faster than (b) on pretrain and sft: {verdict} "
                         f"(lowest {low['dense'] / low['cpu']:.1f}x at {low['mix']} {low['mask']} {low['pass_']}).")
    if tiny_rows:
        parts.append("- tiny documents, speed ratio to (a): "
                     + ", ".join(f"{r['pass_']} Hkv={r['hkv']}: {r['loop'] / r['cpu']:.1f}x" for r in tiny_rows)
                     + ".")
    parts += ["", NOTES]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small subset, under a minute")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 3, quick 1)")
    parser.add_argument("--slow", type=float, default=5.0,
                        help="a case whose first run takes longer (seconds) is timed once (default %(default)s)")
    parser.add_argument("--layouts", type=int, default=None, help="layouts per mix (default 4, quick 1)")
    parser.add_argument("--no-dense", action="store_true", help="skip (b), the slow dense baseline")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny-documents case")
    parser.add_argument("--only", default="", help="comma-separated mix names (default: all)")
    parser.add_argument("--masks", default=",".join(MASKS), help="comma-separated masks (default: %(default)s)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.layouts = args.layouts or (1 if args.quick else 4)
    crops = [2048] if args.quick else [16384, 32768]
    names = args.only.split(",") if args.only else workloads.SHARED_MIXES
    mixes = {name: workloads.layouts(name, count=args.layouts) for name in names}
    masks = {name: MASKS[name] for name in args.masks.split(",")}

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    tiny_rows = [] if args.no_tiny else bench_tiny(512 if args.quick else 4096, [8, 2], args.repeats, args.slow, log)
    rows, dense_rows, interrupted = [], [], False
    try:
        bench_mixes(mixes, crops, args.layouts, [8, 2], masks, args.repeats, args.slow,
                    None if args.no_dense else crops[0], log, rows, dense_rows)
    except KeyboardInterrupt:  # Ctrl-C / SIGINT: report what was measured, marked as partial
        interrupted = True
    print(report(args, rows, dense_rows, tiny_rows, (time.perf_counter() - start) / 60, interrupted))
    return 130 if interrupted else 0  # a partial report is not a result (doccp bench keeps it out of docs/)


if __name__ == "__main__":
    sys.exit(main())
