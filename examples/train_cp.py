"""Train a tiny LLaMA-style model on packed documents with context parallelism.

    torchrun --nproc-per-node 2 examples/train_cp.py      # gloo on CPU, NCCL on GPUs
    python examples/train_cp.py --world-size 2            # no launcher: spawns local gloo ranks

Each step packs source files of the Python standard library (byte tokens) into one stream
of documents. ``doccp.plan`` splits the stream over the ranks so that every rank gets the
same attention work; each rank then runs the model on its own tokens only, and
``doccp.attention`` inside the model fetches the keys its queries need from other ranks.

The loss is the mean over *all* tokens: each rank divides its local token-loss sum by the
global target count, so summing the ranks' losses (and gradients) gives exactly the
one-process loss (and gradients). Step 0 checks that against the whole batch on one process.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import doccp
from doccp.app.corpus import VOCAB, pack, scan, stdlib_dir
from doccp.launch import spawn
from doccp.nn import TinyLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (the whole CP group's batch)")
    p.add_argument("--max-doc-len", type=int, default=1024)
    p.add_argument("--data", default=str(stdlib_dir()), help="folder of text files (default: Python's stdlib)")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def train(rank: int, args: argparse.Namespace, device: torch.device) -> list[float]:
    world_size = dist.get_world_size()
    torch.manual_seed(0)  # every rank builds the same weights
    model = TinyLM(VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    corpus = scan(args.data, "*.py")
    losses = []
    for step in range(args.steps):
        batch = pack(corpus, args.tokens, args.max_doc_len, seed=step)
        targets = batch.layout.next_token_targets(batch.tokens)
        n_targets = int((targets != -100).sum())
        plan = doccp.plan(batch.layout, world_size, model.mask)

        # Forward and backward on this rank's tokens only.
        tokens = doccp.shard(batch.tokens, plan, rank).to(device)
        local_targets = doccp.shard(targets, plan, rank).to(device)
        logits = model(tokens, plan=plan)
        loss = F.cross_entropy(logits, local_targets, reduction="sum", ignore_index=-100) / n_targets
        optimizer.zero_grad(set_to_none=True)
        loss.backward()

        # The ranks' losses and gradients are parts of one sum.
        for p in model.parameters():
            dist.all_reduce(p.grad)
        total = loss.detach()
        dist.all_reduce(total)
        if step == 0:
            check_against_one_process(model, batch, targets, n_targets, float(total), device)
        optimizer.step()

        losses.append(float(total))
        if rank == 0:
            print(f"step {step}  loss {float(total):.4f}  documents {batch.layout.num_docs}  "
                  f"tokens/rank {plan.local_sizes}", flush=True)
    return losses


@torch.no_grad()
def check_against_one_process(model: TinyLM, batch, targets: torch.Tensor, n_targets: int, cp_loss: float,
                              device: torch.device) -> None:
    """The whole batch on this process, without CP (``varlen_attention`` inside the model)."""
    logits = model(batch.tokens.to(device), layout=batch.layout)
    loss = float(F.cross_entropy(logits, targets.to(device), reduction="sum", ignore_index=-100) / n_targets)
    tolerance = 1e-3 if device.type == "cuda" else 1e-4  # TF32 / kernel differences on GPUs
    if abs(cp_loss - loss) > tolerance * abs(loss):
        raise RuntimeError(f"CP loss {cp_loss:.6f} differs from the one-process loss {loss:.6f}")
    if dist.get_rank() == 0:
        print(f"step 0 loss matches one process: {cp_loss:.6f} vs {loss:.6f}", flush=True)


def _spawned(rank: int, args: argparse.Namespace) -> list[float]:
    return train(rank, args, torch.device("cpu"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # launched by torchrun
        cuda = torch.cuda.is_available()
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            train(dist.get_rank(), args, device)
        finally:
            dist.destroy_process_group()
    else:
        spawn(_spawned, args.world_size, args)


if __name__ == "__main__":
    main()
