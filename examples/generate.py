"""Greedy generation with context parallelism: prefill prompts over N ranks, then decode.

    python examples/generate.py --world-size 2            # no launcher: spawns local gloo ranks
    torchrun --nproc-per-node 2 examples/generate.py      # the same under a launcher (gloo, CPU)

A tiny LLaMA-style model (``doccp.nn.TinyLM`` with fixed random weights) reads a batch of
prompts of different lengths. ``doccp.plan`` spreads the prompts' tokens over the ranks;
each layer's ``doccp.prefill`` (plugged in through the model's ``attend`` hook) attends
every token to its whole prompt and leaves the K/V in that layer's ``doccp.ShardedKVCache``.
Then every step feeds one token per prompt: each layer's ``doccp.decode`` attends it to the
cache spread over all ranks and caches its K/V on one rank (round-robin). RoPE positions
are per document: a token's position is its sequence's cached length plus its place among
the new tokens.

The generated tokens are compared with the same model run in one process without CP or a
cache (the whole sequences recomputed each step).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import doccp
from doccp.launch import spawn
from doccp.nn import TinyLM

VOCAB = 256
PROMPT_LENGTHS = (23, 5, 41, 12)


@dataclass
class Generation:
    prompts: list[list[int]]
    cp_tokens: list[list[int]]
    reference_tokens: list[list[int]]


def build_model() -> TinyLM:
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    return TinyLM(VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2).eval()


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def generate_cp(rank: int, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """This rank's part of CP generation (call on every rank of the default group)."""
    world_size = dist.get_world_size()
    model = build_model()
    caches = [doccp.ShardedKVCache.for_group() for _ in model.blocks]

    # Prefill: each rank runs the model on its share of the prompts' tokens.
    layout = doccp.DocLayout.from_lengths([len(p) for p in prompts])
    plan = doccp.plan(layout, world_size, model.mask)
    tokens = doccp.shard(torch.tensor(sum(prompts, [])), plan, rank)
    logits = model(tokens, positions=plan.positions(rank),
                   attend=lambda i, q, k, v: doccp.prefill(q, k, v, plan, caches[i]))
    last = doccp.unshard(logits, plan)[layout.cu_seqlens[1:] - 1]  # each prompt's last token, on every rank
    token = last.argmax(-1)

    # Decode: every rank runs the model on the batch's new tokens; attention is spread.
    generated = [token]
    for _ in range(new_tokens - 1):
        positions = caches[0].lengths  # each token sits right after its sequence's cached ones
        logits = model(token, positions=positions,
                       attend=lambda i, q, k, v: doccp.decode(q, k, v, caches[i], gather=True))
        token = logits.argmax(-1)
        generated.append(token)
    return torch.stack(generated, 1).tolist()


@torch.no_grad()
def generate_reference(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The same greedy generation in one process: whole sequences, no CP, no cache."""
    model = build_model()
    seqs = [list(p) for p in prompts]
    for _ in range(new_tokens):
        layout = doccp.DocLayout.from_lengths([len(s) for s in seqs])
        logits = model(torch.tensor(sum(seqs, [])), layout=layout)
        for s, t in zip(seqs, logits[layout.cu_seqlens[1:] - 1].argmax(-1).tolist(), strict=True):
            s.append(t)
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]


def generate(world_size: int, new_tokens: int = 16, prompts: list[list[int]] | None = None) -> Generation:
    """Generate on ``world_size`` spawned gloo ranks and in one process."""
    prompts = make_prompts() if prompts is None else prompts
    per_rank = spawn(generate_cp, world_size, prompts, new_tokens)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree"
    return Generation(prompts, per_rank[0], generate_reference(prompts, new_tokens))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # launched by torchrun: this process is one rank (CPU, gloo)
        dist.init_process_group("gloo")
        try:
            cp = generate_cp(dist.get_rank(), make_prompts(), args.new_tokens)
            if dist.get_rank() != 0:
                return
            result = Generation(make_prompts(), cp, generate_reference(make_prompts(), args.new_tokens))
        finally:
            dist.destroy_process_group()
    else:
        result = generate(args.world_size, args.new_tokens)
    for prompt, tokens in zip(result.prompts, result.cp_tokens, strict=True):
        print(f"prompt of {len(prompt):>3} tokens -> {tokens}")
    if result.cp_tokens != result.reference_tokens:
        raise SystemExit(f"MISMATCH: one process generated {result.reference_tokens}")
    print("generated tokens match the single-process run")


if __name__ == "__main__":
    main()
