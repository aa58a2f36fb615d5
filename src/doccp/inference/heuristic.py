"""Pass-KV or pass-Q for a prefill: the paper's Algorithm 5, calibrated on the actual group.

T new tokens, P cached, N ranks, H query / Hkv KV heads, head_dim D, e bytes per element.
Every ring step computes ``c = 4 * (T/N) * ((T+P)/N) * H * D / C`` seconds of attention
(C: FLOP/s of one rank) while one hop moves, at BW bytes/s::

    pass-KV   h_kv = 2 * (T+P)/N * Hkv * D * e / BW    (K and V of cached + new tokens)
    pass-Q    h_q  =     T/N   * H   * D * e / BW    + a2a = (N-1) * T/N * H * (D+1) * 4 / BW
                                                       (partial out + lse come home, fp32)

If a hop hides behind the step's compute (cost ``max(c, h)``) and pass-Q's small hop does,
pass-KV wins when ``T >= N*C*Hkv*e / (2*H*BW)`` (its hop hides too) or when
``w * T/(T+P) >= 2*Hkv/H - 4*T*BW/(N*C*e)`` (its exposed hops cost less than pass-Q's
all-to-all): the paper's Algorithm 5, where ``w = 4*(D+1)/(D*e)`` weighs the all-to-all by
the fp32 out + lse doccp sends (the paper counts e-byte outputs: ``w = 1``).

That assumes transfers overlap compute perfectly (true for GPUs with copy engines). On CPU
gloo the transfer runs on the same cores as the attention, so only part of it hides.
:func:`calibrate` therefore also measures ``overlap``, the hidden fraction of a hop posted
before a compute, and a step costs ``c + h - overlap * min(c, h)``; :func:`predict` adds up
both algorithms' steps and :func:`choose_prefill_algorithm` takes the cheaper. With
``overlap = 1`` this is Algorithm 5 above.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from doccp import comm, kernels
from doccp.kernels.slices import Slices
from doccp.masks import Mask

log = logging.getLogger("doccp")


@dataclass(frozen=True)
class Calibration:
    """Measured speeds of this group (the same numbers on every rank)."""

    flops: float  # attention FLOP/s of one rank, counting 4*m*n*H*D per m x n slice
    bandwidth: float  # bytes/s of one ring hop between neighbours (inf for one rank)
    overlap: float = 1.0  # fraction of a hop's time that hides behind compute posted after it


_calibrations: dict[tuple, Calibration] = {}


def calibrate(group: dist.ProcessGroup | None = None, n_heads: int = 8, n_kv_heads: int = 8, head_dim: int = 128,
              dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
              queries: int = 64, keys: int = 8192, hop_bytes: int = 16 << 20, repeats: int = 5) -> Calibration:
    """Measure C, BW and overlap on every rank of ``group`` (collective: call it on all ranks).

    Each repetition times a ``queries x keys`` attention slice, a ring hop of ``hop_bytes``,
    and the hop posted before the same slice. C and BW come from the best times; overlap is
    the median over repetitions of ``(compute + hop - both) / min(compute, hop)``. The
    slowest rank's times count, so every rank decides alike; the result is remembered for
    this process. The default slice reads 8k keys, like a long cache (a small one runs from
    CPU caches and overstates the speed), and takes about as long as the hop on CPU gloo.
    """
    device = torch.device(device)
    members = tuple(dist.get_process_group_ranks(group)) if group is not None else comm.size(group)
    key = (members, str(device), dtype, n_heads, n_kv_heads, head_dim, queries, keys, hop_bytes, repeats)
    if key in _calibrations:
        return _calibrations[key]
    log.info("doccp: calibrating pass-KV vs pass-Q on a group of %d ranks (a collective micro-benchmark, run once "
             "per group and shape; call doccp.inference.calibrate() ahead to choose when)", comm.size(group))
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(queries, n_heads, head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(keys, n_kv_heads, head_dim, generator=g).to(device, dtype) for _ in range(2))
    whole = Slices.of([0], [queries], [0], [keys], [0], [0])
    flops = 4 * queries * keys * n_heads * head_dim

    def compute():
        kernels.attend(q, k, v, whole, Mask.full())

    if comm.size(group) == 1:
        result = Calibration(flops / min(_seconds(compute, device) for _ in range(repeats + 1)), float("inf"), 1.0)
        _calibrations[key] = result
        return result
    block = torch.zeros(hop_bytes // 4, dtype=torch.float32, device=device)

    def hop():
        return comm.RingStep([block], [tuple(block.shape)], [block], group)

    def both():
        posted = hop()
        compute()
        posted.wait()

    with comm.unmeasured():  # measuring is not the caller's traffic
        samples = torch.tensor([[_seconds(f, device) for f in (compute, lambda: hop().wait(), both)]
                                for _ in range(repeats + 1)][1:], dtype=torch.float64)  # the first warms up
    dist.all_reduce(samples, dist.ReduceOp.MAX, group=group)
    c, h, both_s = samples.unbind(1)
    overlap = ((c + h - both_s) / torch.minimum(c, h)).clamp(0, 1).median()
    result = Calibration(flops / float(c.min()), hop_bytes / float(h.min()), float(overlap))
    _calibrations[key] = result
    return result


def _seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def predict(new_tokens: int, cached_tokens: int, world_size: int, n_heads: int, n_kv_heads: int, head_dim: int,
            element_bytes: int, calibration: Calibration) -> dict[str, float]:
    """Predicted seconds of each prefill algorithm (module docstring)."""
    t, p, n, d, e = new_tokens, cached_tokens, world_size, head_dim, element_bytes
    flops, bw, overlap = calibration.flops, calibration.bandwidth, calibration.overlap
    c = 4 * (t / n) * ((t + p) / n) * n_heads * d / flops
    h_kv = 2 * (t + p) / n * n_kv_heads * d * e / bw
    h_q = t / n * n_heads * d * e / bw
    a2a = (n - 1) * t / n * n_heads * (d + 1) * 4 / bw

    def step(hop: float) -> float:
        return c + hop - overlap * min(c, hop)

    return {"pass_kv": (n - 1) * step(h_kv) + c, "pass_q": (n - 1) * step(h_q) + c + a2a}


def choose_prefill_algorithm(new_tokens: int, cached_tokens: int, world_size: int, n_heads: int, n_kv_heads: int,
                             *, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                             flops: float | None = None, bandwidth: float | None = None, overlap: float | None = None,
                             calibration: Calibration | None = None, group: dist.ProcessGroup | None = None,
                             device: torch.device | str = "cpu") -> str:
    """``"pass_kv"`` or ``"pass_q"``: Algorithm 5 with measured overlap (module docstring).

    ``flops`` (attention FLOP/s per rank), ``bandwidth`` (bytes/s per ring hop) and
    ``overlap`` (hidden fraction of a hop, 1 = the paper's assumption) come from
    ``calibration``, else from :func:`calibrate` on ``group`` with these heads, ``head_dim``,
    ``dtype`` and ``device`` (a collective micro-benchmark the first time, then cached); each
    one given explicitly overrides it, and all three decide without measuring.
    """
    if world_size == 1:
        return "pass_kv"  # nothing travels; the two are the same computation
    if flops is None or bandwidth is None or overlap is None:
        measured = calibration or calibrate(group, n_heads, n_kv_heads, head_dim, dtype, device)
        flops = measured.flops if flops is None else flops
        bandwidth = measured.bandwidth if bandwidth is None else bandwidth
        overlap = measured.overlap if overlap is None else overlap
    e = torch.empty(0, dtype=dtype).element_size()
    times = predict(new_tokens, cached_tokens, world_size, n_heads, n_kv_heads, head_dim, e,
                    Calibration(flops, bandwidth, overlap))
    return "pass_kv" if times["pass_kv"] <= times["pass_q"] else "pass_q"
