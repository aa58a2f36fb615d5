"""GPU kernel benchmark: doccp's ``cuda`` backend against the kernel it drives.

    python bench/gpu.py            # 128k tokens per mix (about two minutes on an H100)
    python bench/gpu.py --quick    # 16k tokens, seconds

For each shared mix (``doccp.app.workloads``, layout 0), the whole stream through
``varlen_attention(..., backend="cuda")`` side by side with ONE call of torch's
``varlen_attn`` on the same stream (the same flash kernel: the limit, so the ratio is the
backend's overhead) and, where the ``[T, T]`` mask fits (``--dense-limit``), dense SDPA with a
boolean document mask (a dash where it ran out of memory). H=32, Hkv=8, D=128, bf16, causal
and sliding_window(4096), forward and forward+backward; CUDA-event timing, median of
``--repeats`` rounds (the contenders take turns) after the GPU's clocks have
settled. TFLOP/s counts the visible pairs (4·D flops per pair forward, 2.5x that backward).
Prints a markdown section; record complete runs in docs/gpu.md.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from doccp import DocLayout, Mask
from doccp.app import workloads
from doccp.varlen import varlen_attention

HQ, HKV, DIM = 32, 8, 128
MASKS = {"causal": Mask.causal(), "window(4096)": Mask.sliding_window(4096)}


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each contender over ``repeats`` CUDA-event-timed rounds after two
    warm-up rounds; the contenders take turns within a round, so clock changes hit them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats + 2):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if round_ >= 2:
                times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def warm_up(seconds: float = 2.0) -> None:
    """Matrix products until the GPU's clocks have settled, before the first measurement."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


def contenders(layout: DocLayout, mask: Mask, backward: bool, dense_limit: int) -> dict[str, Callable[[], object]]:
    from torch.nn.attention.varlen import varlen_attn

    t = layout.num_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(t, h, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
                     for h in (HQ, HKV, HKV, HQ))
    leaves = [x.requires_grad_(backward) for x in (q, k, v)]
    cu = layout.cu_seqlens.to("cuda", torch.int32)
    longest = int(layout.lengths.max())
    window = mask.window_size()

    def run(fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def call():
            out = fn()
            if backward:
                torch.autograd.grad(out, leaves, dout)
        return call

    # torch 2.13 asks for enable_gqa; earlier flash varlen reads Hq != Hkv as grouped on its own
    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    found = {
        "doccp cuda": run(lambda: varlen_attention(*leaves, layout, mask, backend="cuda")),
        "one varlen_attn": run(lambda: varlen_attn(q, k, v, cu, cu, longest, longest, window_size=window, **gqa)),
    }
    if t <= dense_limit:
        allowed = _dense_mask(layout, mask)
        found["dense SDPA + mask"] = run(lambda: F.scaled_dot_product_attention(
            *(x.transpose(0, 1) for x in (q, k, v)), attn_mask=allowed, enable_gqa=True).transpose(0, 1))
    return found


def _dense_mask(layout: DocLayout, mask: Mask) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(layout.num_docs), layout.lengths).cuda()
    pos = torch.arange(layout.num_tokens, device="cuda") - layout.cu_seqlens[:-1].cuda()[doc]
    same = doc[:, None] == doc[None, :]
    return same & mask.allows(pos[:, None], pos[None, :])


def flops(layout: DocLayout, mask: Mask, backward: bool) -> float:
    zero = torch.zeros_like(layout.lengths)
    pairs = float(mask.pairs(zero, layout.lengths, zero, layout.lengths).sum())
    return pairs * 4 * DIM * HQ * (3.5 if backward else 1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16k tokens per mix")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per layout (default 131072)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dense-limit", type=int, default=16384, help="largest T for dense SDPA with a mask")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device", file=sys.stderr)
        return 2
    tokens = args.tokens or (16384 if args.quick else 131072)
    warm_up()
    print(f"## GPU kernels ({torch.cuda.get_device_name()}, torch {torch.__version__})\n")
    print(f"`python bench/gpu.py{' --quick' if args.quick else ''}`: {tokens} tokens per mix, H={HQ}, Hkv={HKV}, "
          f"D={DIM}, bf16; median of {args.repeats} CUDA-event timings.\n")
    print("| mix | docs | mask | pass | doccp cuda ms | one varlen_attn ms | overhead | dense SDPA ms | "
          "doccp TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mix in workloads.SHARED_MIXES:
        layout = DocLayout.from_lengths(workloads.layout(mix, tokens))
        for mask_name, mask in MASKS.items():
            for backward in (False, True):
                fns = contenders(layout, mask, backward, args.dense_limit)
                try:
                    ms = timed(fns, args.repeats)
                except torch.OutOfMemoryError:  # dense SDPA may fall back to a [H, T, T] kernel
                    torch.cuda.empty_cache()
                    fns.pop("dense SDPA + mask", None)
                    ms = timed(fns, args.repeats)
                mine, limit = ms["doccp cuda"], ms["one varlen_attn"]
                dense = ms.get("dense SDPA + mask")
                tflops = flops(layout, mask, backward) / mine / 1e9
                print(f"| {mix} | {layout.num_docs} | {mask_name} | {'fwd+bwd' if backward else 'fwd'} | "
                      f"{mine:.2f} | {limit:.2f} | {mine / limit - 1:+.1%} | "
                      f"{'-' if dense is None else f'{dense:.2f}'} | {tflops:.0f} |")
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
