"""Distributed CP attention on CPU gloo ranks vs one process, side by side in one run.

For the first layout of each mix (cropped to T tokens): fwd+bwd time of every training
algorithm of the registry x strategy at 2 and 4 ranks, the speedup over one process running
``varlen_attention`` on the whole stream (all cores), the bytes each rank receives in the
forward pass (absolute, and vs a full all-gather of K and V), and which algorithm ``auto``
picks for each mix, ranks and strategy next to the fastest one measured. The hybrid runs on a
``HybridGroup`` of Ulysses groups of N/2 ranks (2 x 2 at 4 ranks; it needs N >= 4), which every
algorithm at that N shares, so ``auto`` weighs the hybrid too. Torch threads per rank = cores /
ranks. Optionally PyTorch's FlexAttention CP (forward only on CPU) on the same inputs, next to
doccp's forward-only time.

    python bench/cp.py            # full run
    python bench/cp.py --quick    # smaller, for a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import doccp
from doccp import DocLayout, Mask, comm
from doccp.algorithms import choose_algorithm, training
from doccp.algorithms.registry import Shapes
from doccp.app import workloads
from doccp.launch import spawn

H, HKV, D = 8, 2, 64


def crop(lengths: list[int], tokens: int) -> list[int]:
    out, total = [], 0
    for n in lengths:
        if total >= tokens:
            break
        out.append(min(n, tokens - total))
        total += out[-1]
    return out


def inputs(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, D, generator=g) for h in (H, HKV, HKV, H)]


def timed(fn, repeats: int, barrier: bool) -> float:
    fn()  # warm-up (also builds the plan's cached schedule)
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        fn()
        if barrier:
            dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def single(rank: int, lengths: list[int], repeats: int) -> float:
    layout = DocLayout.from_lengths(lengths)
    q, k, v, dout = inputs(layout.num_tokens)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def step():
        out = doccp.varlen_attention(q, k, v, layout, Mask.causal())
        out.backward(dout)

    return timed(step, repeats, barrier=False)


def cp_group(world_size: int) -> doccp.HybridGroup | None:
    """Ulysses groups of N/2 ranks (2 x 2 at 4 ranks), or None where N cannot be factored."""
    return doccp.HybridGroup.create(world_size // 2) if world_size >= 4 and world_size % 2 == 0 else None


def distributed(rank: int, world_size: int, lengths: list[int], configs: list[tuple[str, str]], repeats: int):
    """Per config: (fwd+bwd s, bytes received in the forward, full K/V all-gather bytes, fwd s),
    or None where the algorithm cannot run here; per strategy: the algorithm ``auto`` picks."""
    layout = DocLayout.from_lengths(lengths)
    full = inputs(layout.num_tokens)
    group = cp_group(world_size)
    shapes = Shapes(H, HKV, D, 4)
    results = {}
    for strategy in dict.fromkeys(s for s, _ in configs):
        plan = doccp.plan(layout, world_size, Mask.causal(), strategy)
        results[(strategy, "auto")] = choose_algorithm(plan, shapes, "cpu", group)
    for strategy, algorithm in configs:
        plan = doccp.plan(layout, world_size, Mask.causal(), strategy)
        if training()[algorithm].for_group(group).problem(plan, shapes, group) is not None:
            results[(strategy, algorithm)] = None
            continue
        q, k, v, dout = (doccp.shard(x, plan, rank) for x in full)
        q, k, v = (x.requires_grad_() for x in (q, k, v))

        def step(plan=plan, q=q, k=k, v=v, dout=dout, algorithm=algorithm):
            out = doccp.attention(q, k, v, plan, group=group, algorithm=algorithm)
            out.backward(dout)

        def forward(plan=plan, q=q, k=k, v=v, algorithm=algorithm):
            doccp.attention(q.detach(), k.detach(), v.detach(), plan, group=group, algorithm=algorithm)

        seconds = timed(step, repeats, barrier=True)
        with torch.no_grad():
            fwd_seconds = timed(forward, repeats, barrier=True)
        with comm.measure() as fwd:
            forward()
        full_allgather = (layout.num_tokens - plan.local_sizes[rank]) * 2 * HKV * D * 4
        results[(strategy, algorithm)] = (seconds, fwd.received, full_allgather, fwd_seconds)
    return results


def flex_forward(rank: int, world_size: int, lengths: list[int], repeats: int):
    """PyTorch FlexAttention CP with its per-document head-tail balancer (forward only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _context_parallel_shard,
        _ContextParallel,
        _create_cp_block_mask,
    )
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PerDocumentHeadTailLoadBalancer,
    )
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    step = 2 * world_size
    padded = [-(-n // step) * step for n in lengths]  # the balancer requires multiples of 2N
    block = world_size * 128
    tail = -sum(padded) % block
    if tail:
        padded.append(tail + (-tail % step))
    total = sum(padded)
    mesh = init_device_mesh("cpu", (world_size,))
    doc = torch.repeat_interleave(torch.arange(len(padded)), torch.tensor(padded))

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    balancer = _PerDocumentHeadTailLoadBalancer([padded], world_size, "cpu")
    block_mask = _create_cp_block_mask(mask_mod, 1, 1, total, total, mesh, balancer)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, total, D, generator=g)
    k = torch.randn(1, HKV, total, D, generator=g)
    v = torch.randn(1, HKV, total, D, generator=g)
    q, k, v = _context_parallel_shard(mesh, [q, k, v], [2, 2, 2], load_balancer=balancer)
    compiled = torch.compile(flex_attention)

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)

    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
    attn = parallelize_module(Attn(), mesh, style)
    seconds = timed(lambda: attn(q, k, v, block_mask=block_mask), repeats, barrier=True)
    return seconds, total - sum(lengths)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T=8192, world size 2, fewer repeats")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per layout (default 32768; quick 8192)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention CP baseline")
    ap.add_argument("--only", default="", help="comma-separated mix names (default: all)")
    ap.add_argument("--ranks", default="", help="comma-separated world sizes (default 2,4; quick 2)")
    args = ap.parse_args(argv)
    tokens = args.tokens or (8192 if args.quick else 32768)
    repeats = args.repeats or (2 if args.quick else 3)
    world_sizes = [int(n) for n in args.ranks.split(",")] if args.ranks else [2] if args.quick else [2, 4]
    cores = os.cpu_count() or 1
    names = args.only.split(",") if args.only else workloads.SHARED_MIXES
    mixes = {name: workloads.layouts(name, count=1) for name in names}
    configs = [(s, a) for s in ("head_tail", "balanced") for a in training()]

    cmd = " ".join(["python bench/cp.py", *(sys.argv[1:] if argv is None else argv)])
    print("## Distributed CP attention (training, fwd+bwd)\n")
    print(f"`{cmd}` — T={tokens} (first layout of each mix, cropped), H={H}, Hkv={HKV}, D={D}, fp32, causal, "
          f"gloo on {cores} CPU cores, torch threads per rank = cores / ranks, median of {repeats}. "
          "Speedup = one process (`varlen_attention`, all cores; mean of its medians before and after the CP "
          "runs) / CP time. "
          "Recv = bytes the busiest rank receives in the forward pass (K and V for the all-gather and ring; q, k, v "
          "and out + lse for the all-to-all of Ulysses and the hybrid), also / a full all-gather of K and V. At 4 "
          "ranks and more the CP group is a `HybridGroup` of Ulysses groups of N/2 ranks (2 x 2 at 4), so the "
          "hybrid runs (and `auto` weighs it) only there.\n")
    rows, checks, flex_rows, scaling, autos = [], [], [], [], []
    for mix, layouts in mixes.items():
        lengths = crop(layouts[0], tokens)
        # One process before and after the CP runs (mean of the two medians), so load drifting
        # on a shared machine hits the baseline as it hits the CP runs in between.
        base, one_thread = (spawn(single, 1, lengths, repeats, threads=t, timeout_s=1800)[0] for t in (cores, 1))
        for n in world_sizes:
            per_rank = spawn(distributed, n, n, lengths, configs, repeats, threads=max(1, cores // n),
                             timeout_s=1800)
            for cfg in configs:
                if per_rank[0][cfg] is None:
                    continue
                seconds, fwd_seconds, received = (max(r[cfg][i] for r in per_rank) for i in (0, 3, 1))
                kv = max(r[cfg][1] / max(r[cfg][2], 1) for r in per_rank)
                rows.append((mix, n, *cfg, base, seconds, base / seconds, kv, fwd_seconds, received))
                print(f"{mix} {n} ranks {cfg[0]} {cfg[1]}: {seconds * 1e3:.1f} ms (one process before: "
                      f"{base * 1e3:.1f} ms)", file=sys.stderr, flush=True)
            for strategy in dict.fromkeys(s for s, _ in configs):
                timed_here = {r[3]: r[5] for r in rows if r[:3] == (mix, n, strategy)}
                picked, fastest = per_rank[0][(strategy, "auto")], min(timed_here, key=timed_here.get)
                autos.append((mix, n, strategy, picked, fastest, timed_here[picked] / timed_here[fastest]))
            if not args.no_flex and not args.quick:
                try:
                    seconds, pad = spawn(flex_forward, n, n, lengths, repeats, threads=max(1, cores // n),
                                         timeout_s=900)[0]
                    ours = min(r[8] for r in rows if r[:3] == (mix, n, "balanced"))
                    flex_rows.append((mix, n, f"{seconds * 1e3:.1f}", pad, f"{ours * 1e3:.1f}",
                                      f"{seconds / ours:.2f}x"))
                except Exception as e:  # report, don't hide, a baseline that does not run here
                    flex_rows.append((mix, n, f"did not run: {str(e).splitlines()[0][:120]}", "-", "-", "-"))
        after = (spawn(single, 1, lengths, repeats, threads=t, timeout_s=1800)[0] for t in (cores, 1))
        base_after, one_thread_after = after
        print(f"mix `{mix}`: {len(lengths)} documents; one process {base * 1e3:.0f} ms before the CP runs, "
              f"{base_after * 1e3:.0f} ms after", file=sys.stderr)
        base, one_thread = (base + base_after) / 2, (one_thread + one_thread_after) / 2
        scaling.append((mix, len(lengths), base, one_thread))
        for i, row in enumerate(rows):
            if row[0] == mix:
                rows[i] = (*row[:4], base, row[5], base / row[5], *row[7:])
    print("| mix | ranks | strategy | algorithm | 1 process (ms) | CP (ms) | speedup | recv / rank (MB) "
          "| recv / K+V all-gather | CP fwd only (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mix, n, strategy, algorithm, base, seconds, speedup, kv, fwd_seconds, received in rows:
        print(f"| {mix} | {n} | {strategy} | {algorithm} | {base * 1e3:.1f} | {seconds * 1e3:.1f} | {speedup:.2f}x "
              f"| {received / 1e6:.2f} | {kv:.1%} | {fwd_seconds * 1e3:.1f} |")
    print("\nWhere `auto` lands (`choose_algorithm` on CPU, the rule in docs/architecture.md) vs the fastest "
          "fwd+bwd measured above:\n")
    print("| mix | ranks | strategy | auto picks | fastest measured | auto time / fastest |\n|---|---|---|---|---|---|")
    for mix, n, strategy, picked, fastest, ratio in autos:
        print(f"| {mix} | {n} | {strategy} | {picked} | {fastest} | {ratio:.2f}x |")
    for mix in ("sft", "pretrain"):
        best = max((r for r in rows if r[0] == mix and r[1] == 2 and r[2] == "balanced"), key=lambda r: r[6],
                   default=None)
        if best:
            checks.append((f"`{mix}`, 2 ranks, balanced + best algorithm ({best[3]}): fwd+bwd speedup >= 1.6x",
                           f"{best[6]:.2f}x", best[6] >= 1.6))
    sft_kv = [r[7] for r in rows if r[0] == "sft" and r[2] == "balanced" and r[3] == "allgather"]
    if sft_kv:
        checks.append(("`sft`, balanced + allgather: KV bytes received per rank <= 15% of a full all-gather",
                       f"{max(sft_kv):.1%}", max(sft_kv) <= 0.15))
    print(f"\nHow well one process already uses the {cores} cores, and what that leaves for CP: with perfect "
          f"balance and free communication, {cores} single-threaded ranks take T(1 thread) / {cores}, so the "
          f"speedup over one process can be at most {cores} x T({cores} threads) / T(1 thread).\n")
    print(f"| mix | documents | 1 process, 1 thread (ms) | 1 process, {cores} threads (ms) | thread scaling | "
          "CP speedup bound |\n|---|---|---|---|---|---|")
    for mix, docs, base, one_thread in scaling:
        print(f"| {mix} | {docs} | {one_thread * 1e3:.1f} | {base * 1e3:.1f} | {one_thread / base:.2f}x | "
              f"{cores * base / one_thread:.2f}x |")
    print("\n| target | measured | |\n|---|---|---|")
    for what, got, ok in checks:
        print(f"| {what} | {got} | {'PASS' if ok else 'MISS'} |")
    if flex_rows:
        print("\nPyTorch FlexAttention CP (`_ContextParallel` FLEX + `_PerDocumentHeadTailLoadBalancer`), "
              "forward only on CPU, same documents padded to multiples of 2N (and the stream to N*128):\n")
        print("| mix | ranks | FlexAttention CP fwd (ms) | its padding tokens | doccp balanced fwd (ms) | "
              "doccp speedup |\n|---|---|---|---|---|---|")
        for row in flex_rows:
            print("| " + " | ".join(str(x) for x in row) + " |")
    print()


if __name__ == "__main__":
    main()
