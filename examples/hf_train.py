"""Fine-tune a tiny Hugging Face transformers Llama on packed documents with doccp CP.

    torchrun --nproc-per-node 2 examples/hf_train.py      # gloo on CPU, NCCL on GPUs
    python examples/hf_train.py --world-size 2            # no launcher: spawns local gloo ranks

A plain PyTorch loop around a transformers model (built from a config, nothing downloaded):
source files of the Python standard library become documents of byte tokens, transformers'
``DataCollatorWithFlattening`` packs them padding-free, and ``doccp.hf.shard_batch`` gives
every rank its part of the stream plus the plan that the model's attention layers
(``attn_implementation="doccp"``) use to attend across ranks. Each rank's loss is its part of
one sum; the gradients are summed over the group (``doccp.hf.all_reduce_gradients``).

Rank 0 also trains a copy of the model on one process with transformers' own ``sdpa``
attention on the same batches, and prints both loss curves side by side: they are equal.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

import doccp.hf
from doccp.app.corpus import VOCAB, pack, scan, stdlib_dir
from doccp.launch import spawn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (the whole CP group's batch)")
    p.add_argument("--max-doc-len", type=int, default=1024)
    p.add_argument("--data", default=str(stdlib_dir()), help="folder of text files (default: Python's stdlib)")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def build_model(attn: str, device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)  # every rank (and the one-process copy) starts from the same weights
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation=attn)
    return LlamaForCausalLM(config).to(device)


def packed_batch(corpus, args: argparse.Namespace, step: int) -> dict:
    """The step's documents as transformers' padding-free collator packs them."""
    batch = pack(corpus, args.tokens, args.max_doc_len, seed=step)
    documents = batch.tokens.split(batch.layout.lengths.tolist())
    return DataCollatorWithFlattening()([{"input_ids": doc.tolist()} for doc in documents])


def train(rank: int, args: argparse.Namespace, device: torch.device) -> list[float]:
    doccp.hf.register()  # attn_implementation="doccp"
    model = build_model("doccp", device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    reference = OneProcess(device, args.lr) if rank == 0 else None
    corpus = scan(args.data, "*.py")
    losses = []
    for step in range(args.steps):
        batch = {k: v.to(device) for k, v in packed_batch(corpus, args, step).items()}
        local = doccp.hf.shard_batch(batch)  # this rank's tokens, positions, shifted labels + the plan
        loss = model(**local).loss  # this rank's part of the batch's mean loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        doccp.hf.all_reduce_gradients(model)  # the ranks' gradients are parts of one sum
        optimizer.step()

        total = loss.detach()
        dist.all_reduce(total)
        losses.append(float(total))
        if reference is not None:
            expected = reference.step(batch)
            tolerance = 1e-3 if device.type == "cuda" else 1e-4  # TF32 / kernel differences on GPUs
            if abs(losses[-1] - expected) > tolerance * abs(expected):
                raise RuntimeError(f"step {step}: CP loss {losses[-1]:.6f} differs from one process's {expected:.6f}")
            print(f"step {step}  loss {losses[-1]:.4f}  one process (sdpa) {expected:.4f}  "
                  f"documents {local.plan.layout.num_docs}  tokens/rank {local.plan.local_sizes}",
                  flush=True)
    if reference is not None:
        print(f"the CP loss curve equals one process's over {args.steps} steps", flush=True)
    return losses


class OneProcess:
    """The same model and optimizer on one process, transformers' own sdpa attention, whole batches."""

    def __init__(self, device: torch.device, lr: float):
        self.model = build_model("sdpa", device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, batch: dict) -> float:
        loss = self.model(**batch).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


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
