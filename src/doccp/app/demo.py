"""The demo's workload: a tiny LM on a packed batch, under CP and in one process, compared.

The same code runs in two launch modes:

* ``doccp demo`` (or ``python -m doccp.app.demo``): this process plans, runs the one-process
  reference, and spawns ``--world-size`` gloo ranks for the CP runs (:func:`cp_rank`);
* ``torchrun --nproc-per-node N -m doccp.app.demo --backend nccl``: every process is one rank
  (``env://`` rendezvous); rank 0 also runs the reference and prints the report.

Every rank builds the same model from the same seed (fixed random weights), takes its
shard of the batch from the plan, and runs forward + backward with each CP algorithm. The
loss is a sum over local tokens divided by the global target count, so summing the ranks'
parameter gradients gives exactly the one-process gradient of the mean loss.

Then every document becomes a prompt: each layer's ``doccp.prefill`` (pass-KV, then pass-Q)
fills a ``ShardedKVCache`` and ``doccp.decode`` generates a few tokens greedily. One process
checks them with a single forward over prompts + generated tokens (teacher forcing): the
logits at every generated position must match and their argmax must be the token chosen.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

import doccp
import doccp.algorithms
import doccp.varlen  # noqa: F401  (imported up front, so no timed step pays for imports)
from doccp import comm
from doccp.algorithms.registry import ALGORITHMS, Shapes, prefilling
from doccp.algorithms.ulysses import heads_problem
from doccp.app.corpus import VOCAB
from doccp.inference import ShardedKVCache, decode, prefill
from doccp.layout import DocLayout
from doccp.masks import Mask
from doccp.nn import TinyLM
from doccp.plan import Plan

#: The tiny model: LLaMA-style blocks (RMSNorm, RoPE on document positions, GQA, SwiGLU).
MODEL = {"vocab": VOCAB, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}

#: Max error of CP vs one process, relative to the largest reference magnitude. (Not bf16:
#: there the one-process reference itself drifts, e.g. embedding gradients summed in bf16.)
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}

#: Prefill algorithms the demo checks (each followed by the same decode steps): all of them.
PREFILL = tuple(prefilling())

#: The model's attention shapes, as the algorithms' head checks see them.
SHAPES = Shapes(MODEL["n_heads"], MODEL["n_kv_heads"], MODEL["dim"] // MODEL["n_heads"], 4)


def hybrid_size(world_size: int) -> int | None:
    """Ulysses group size U of the demo's hybrid: the largest proper factor of ``world_size``
    (``1 < U < N``, so both the all-to-all and the exchange across run) whose ranks the model's
    heads split over; None where there is none (N = 2, 3, ...)."""
    return next((u for u in range(world_size - 1, 1, -1)
                 if world_size % u == 0 and heads_problem(SHAPES, u, "ranks") is None), None)


def unavailable(algorithm: str, world_size: int) -> str | None:
    """Why the demo's model cannot be trained with ``algorithm`` on ``world_size`` ranks, or None."""
    if algorithm == "hybrid":  # the one that needs a HybridGroup: the demo factors the world (hybrid_size)
        return None if hybrid_size(world_size) else (
            f"the hybrid needs Ulysses groups of U ranks, 1 < U < {world_size}, U dividing the world size and the "
            f"model's {SHAPES.heads} query heads split over U ranks: run it with --world-size 4 or 8")
    plan = doccp.plan(DocLayout.from_lengths([world_size]), world_size)
    problem = ALGORITHMS[algorithm].problem(plan, SHAPES, None)
    return None if problem is None else str(problem)


@dataclass(frozen=True)
class Workload:
    """Everything a rank needs (picklable, sent to spawned ranks)."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    mask: Mask
    strategy: str
    algorithms: tuple[str, ...]
    dtype: torch.dtype = torch.float32
    seed: int = 0
    decode_tokens: int = 8

    @property
    def generates(self) -> bool:
        """Whether the demo decodes: some tokens asked for, and a mask that never looks ahead."""
        return self.decode_tokens > 0 and not self.mask.looks_ahead

    @property
    def layout(self) -> DocLayout:
        return DocLayout.from_cu_seqlens(self.cu_seqlens)

    def plan(self, world_size: int) -> Plan:
        return doccp.plan(self.layout, world_size, self.mask, self.strategy)


@dataclass
class Run:
    """One forward+backward: full-stream logits, loss, parameter gradients, and cost."""

    name: str
    logits: torch.Tensor
    loss: float
    grads: dict[str, torch.Tensor]
    seconds: list[float] = field(default_factory=list)  # per rank
    received: list[int] = field(default_factory=list)  # bytes per rank
    threads: int = 1  # torch threads per process


@dataclass(frozen=True)
class Errors:
    """Max abs error relative to the reference's max magnitude, per compared quantity."""

    logits: float
    loss: float
    grads: float

    def worst(self) -> float:
        return max(self.logits, self.loss, self.grads)


@dataclass
class Generation:
    """Greedy generation under CP: tokens ``[B, n]`` and the logits that chose them ``[n, B, V]``."""

    name: str
    tokens: torch.Tensor
    logits: torch.Tensor
    prefill_seconds: list[float] = field(default_factory=list)  # per rank
    decode_seconds: list[float] = field(default_factory=list)
    received: list[int] = field(default_factory=list)


def build_model(work: Workload, device: torch.device) -> torch.nn.Module:
    """The tiny LM with fixed random weights: every process builds the same one."""
    torch.manual_seed(work.seed)
    return TinyLM(**MODEL, mask=work.mask).to(device=device, dtype=work.dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, n_targets: int,
          **where) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Forward + backward of ``sum(local token losses) / n_targets``; returns logits, loss, seconds."""
    model.zero_grad(set_to_none=True)
    _sync(tokens.device)
    start = time.perf_counter()
    logits = model(tokens, **where)
    logits_hp = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss in fp32 or better
    loss = F.cross_entropy(logits_hp, targets, reduction="sum", ignore_index=-100) / n_targets
    loss.backward()
    _sync(tokens.device)
    return logits.detach(), loss.detach(), time.perf_counter() - start


def single_process(work: Workload, device: torch.device | str = "cpu") -> Run:
    """The reference: the whole batch in one process (``varlen_attention`` inside the model)."""
    device = torch.device(device)
    model = build_model(work, device)
    layout = work.layout
    tokens = work.tokens.to(device)
    targets = layout.next_token_targets(work.tokens).to(device)
    n_targets = int((targets != -100).sum())
    logits, loss, seconds = _step(model, tokens, targets, n_targets, layout=layout)
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    return Run("1 process", logits.cpu(), float(loss), grads, [seconds], threads=torch.get_num_threads())


def cp_rank(rank: int, work: Workload, tick: Callable[[], None] | None = None,
            group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> dict[str, list[dict]]:
    """One CP rank's share of the demo, inside an initialised process group.

    ``"train"``: per algorithm, forward + backward on this rank's shard, gradients summed over
    the group; this rank's local logits, the loss, the summed gradients (rank 0 only),
    seconds and bytes moved. ``"generate"``: per prefill algorithm, :func:`generate_cp`.
    Rank 0 calls ``tick`` after each run.
    """
    device = torch.device(device)
    n = comm.size(group)
    plan = work.plan(n)
    model = build_model(work, device)
    targets = plan.layout.next_token_targets(work.tokens)
    n_targets = int((targets != -100).sum())
    tokens = doccp.shard(work.tokens, plan, rank).to(device)
    targets = doccp.shard(targets, plan, rank).to(device)
    ticked = tick if tick is not None and rank == 0 else (lambda: None)
    hybrid = None
    if "hybrid" in work.algorithms:  # made up front, by every process of the world
        if group is not None:
            raise ValueError("the demo's hybrid factors the whole world into Ulysses groups; run it without group=")
        hybrid = doccp.HybridGroup.create(hybrid_size(n))
    dist.barrier(group)  # ranks start timing together (rank 0 may have been drawing plans)
    train = []
    for algorithm in work.algorithms:
        with comm.measure() as traffic:
            logits, loss, seconds = _step(model, tokens, targets, n_targets, plan=plan,
                                          group=hybrid if algorithm == "hybrid" else group, algorithm=algorithm)
        dist.all_reduce(loss, group=group)
        grads = {}
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad, group=group)
            if rank == 0:
                grads[name] = p.grad.detach().cpu()
        train.append({"algorithm": algorithm, "logits": logits.cpu(), "loss": float(loss), "grads": grads,
                      "seconds": seconds, "received": traffic.received,
                      "threads": torch.get_num_threads()})
        ticked()
    runs = []
    for algorithm in PREFILL if work.generates else ():
        runs.append(generate_cp(rank, model, plan, tokens, work.decode_tokens, algorithm, group))
        ticked()
    return {"train": train, "generate": runs}


@torch.no_grad()
def generate_cp(rank: int, model: torch.nn.Module, plan: Plan, tokens: torch.Tensor, steps: int, algorithm: str,
                group: dist.ProcessGroup | None = None) -> dict:
    """Every document of the plan is a prompt: prefill this rank's tokens into per-layer
    caches with ``algorithm``, then decode ``steps - 1`` more tokens greedily. Returns the
    tokens and logits (rank 0 only), seconds and bytes received."""
    caches = [ShardedKVCache.for_group(group) for _ in model.blocks]
    last = plan.layout.cu_seqlens[1:] - 1
    with comm.measure() as traffic:
        _sync(tokens.device)
        start = time.perf_counter()
        logits = model(tokens, positions=plan.positions(rank).to(tokens.device),
                       attend=lambda i, q, k, v: prefill(q, k, v, plan, caches[i], group, algorithm=algorithm))
        logits = doccp.unshard(logits, plan, group)[last.to(tokens.device)]
        _sync(tokens.device)
        prefilled = time.perf_counter()
        chosen = [logits]
        for _ in range(steps - 1):
            token = chosen[-1].argmax(-1)
            positions = caches[0].lengths.to(tokens.device)  # right after each sequence's cached tokens
            chosen.append(model(token, positions=positions,
                                attend=lambda i, q, k, v: decode(q, k, v, caches[i], group, gather=True)))
        _sync(tokens.device)
        done = time.perf_counter()
    logits = torch.stack(chosen).cpu()
    return {"algorithm": algorithm, "tokens": logits.argmax(-1).T if rank == 0 else None,
            "logits": logits if rank == 0 else None, "prefill": prefilled - start, "decode": done - prefilled,
            "received": traffic.received}


@torch.no_grad()
def check_generation(work: Workload, gen: Generation, device: torch.device | str = "cpu") -> tuple[float, bool]:
    """One forward over prompts + generated tokens (teacher forcing) in one process: the max
    error of the generation's logits (relative to the largest) and whether every token is
    the argmax of the one-process logits."""
    layout, steps = work.layout, gen.tokens.shape[1]
    lengths = layout.lengths + steps - 1
    starts, ends = layout.cu_seqlens[:-1].tolist(), layout.cu_seqlens[1:].tolist()
    seqs = torch.cat([torch.cat([work.tokens[a:b], new[:-1]])
                      for a, b, new in zip(starts, ends, gen.tokens, strict=True)])
    extended = DocLayout.from_lengths(lengths)
    model = build_model(work, torch.device(device))
    logits = model(seqs.to(device), layout=extended).cpu()
    at = (extended.cu_seqlens[:-1] + layout.lengths - 1)[None, :] + torch.arange(steps)[:, None]  # [n, B]
    ref = logits[at]
    error = float((gen.logits.double() - ref.double()).abs().max() / ref.double().abs().max())
    return error, bool(torch.equal(ref.argmax(-1).T, gen.tokens))


def assemble(plan: Plan, per_rank: list[dict[str, list[dict]]]) -> tuple[list[Run], list[Generation]]:
    """Per-rank results of :func:`cp_rank` -> one :class:`Run` per algorithm (logits in
    stream order) and one :class:`Generation` per prefill algorithm."""
    runs = []
    for i, first in enumerate(per_rank[0]["train"]):
        ranks = [results["train"][i] for results in per_rank]
        logits = torch.empty(plan.layout.num_tokens, *first["logits"].shape[1:], dtype=first["logits"].dtype)
        for r, res in enumerate(ranks):
            logits[plan.indices(r)] = res["logits"]
        runs.append(Run(first["algorithm"], logits, first["loss"], first["grads"],
                        [r["seconds"] for r in ranks], [r["received"] for r in ranks], first["threads"]))
    gens = []
    for i, first in enumerate(per_rank[0]["generate"]):
        ranks = [results["generate"][i] for results in per_rank]
        gens.append(Generation(first["algorithm"], first["tokens"], first["logits"], [r["prefill"] for r in ranks],
                               [r["decode"] for r in ranks], [r["received"] for r in ranks]))
    return runs, gens


def compare(ref: Run, run: Run) -> Errors:
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.double(), b.double()
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0

    return Errors(
        logits=rel(run.logits, ref.logits),
        loss=abs(run.loss - ref.loss) / max(abs(ref.loss), 1e-30),
        grads=max(rel(run.grads[n], g) for n, g in ref.grads.items()),
    )


# -- torchrun entry ------------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def main(argv: list[str] | None = None) -> int:
    """``python -m doccp.app.demo [flags]``: the ``doccp demo`` command, torchrun-aware."""
    from doccp.app.cli.main import main as cli_main

    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
