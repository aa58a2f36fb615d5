"""A transformers Llama on packed documents: HF's sdpa vs doccp attention vs doccp CP, side by side.

The tiny Llama of examples/hf_train.py (2 layers, hidden 64, 4 query / 2 KV heads, byte
vocabulary), one forward + backward per step on T tokens packed from the standard library's
``.py`` files (``DataCollatorWithFlattening``):

- one process, transformers' ``sdpa`` with its packed-sequence mask (a dense ``[T, T]`` mask);
- one process, ``attn_implementation="doccp"`` (documents from ``position_ids``, no mask);
- 2 CP ranks, doccp attention on ``shard_batch``'s shards.

Time per step: median over repeats, of the slowest rank. Memory per rank: the peak RSS of the
process (``ru_maxrss``; every configuration runs in fresh processes), and its growth over the RSS
just before the first step, which is the step's working memory (activations, masks, gathered K/V)
without the interpreter, libraries and weights. RSS, not tracemalloc: torch allocates outside
Python's allocator. Torch threads per rank = cores / ranks.

    python bench/hf.py            # T=16384
    python bench/hf.py --quick    # T=4096, fewer repeats
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from doccp.launch import spawn

CONFIGS = [("HF sdpa (packed-sequence mask)", "sdpa", 1), ("doccp attention", "doccp", 1), ("doccp CP", "doccp", 2)]


def rss_mb() -> float:
    """Resident set size now (Linux /proc), in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def run(rank: int, attn: str, tokens: int, max_doc_len: int, repeats: int) -> tuple[float, float, float, float, int]:
    """Median step time, loss, peak RSS, its growth over the pre-step RSS, and the document count."""
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

    import doccp.hf
    from doccp.app.corpus import pack, scan, stdlib_dir

    doccp.hf.register()
    torch.manual_seed(0)  # the model of examples/hf_train.py
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                         attn_implementation=attn))
    packed = pack(scan(stdlib_dir(), "*.py"), tokens, max_doc_len, seed=0)
    documents = packed.tokens.split(packed.layout.lengths.tolist())
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in documents])
    distributed = dist.is_initialized() and dist.get_world_size() > 1

    def step() -> float:
        inputs = doccp.hf.shard_batch(batch) if attn == "doccp" else batch
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        if distributed:
            doccp.hf.all_reduce_gradients(model)
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        return float(loss.detach())

    before = rss_mb()
    loss = step()
    step()  # warm-up
    times = []
    for _ in range(repeats):
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = peak_rss_mb()
    return statistics.median(times), loss, peak, peak - before, packed.layout.num_docs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T=4096, fewer repeats")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 16384; quick 4096)")
    ap.add_argument("--max-doc-len", type=int, default=1024, help="files longer than this are cut into documents")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    tokens = args.tokens or (4096 if args.quick else 16384)
    repeats = args.repeats or (2 if args.quick else 5)
    cores = os.cpu_count() or 1
    rows = []
    for name, attn, ranks in CONFIGS:
        per_rank = spawn(run, ranks, attn, tokens, args.max_doc_len, repeats, threads=max(1, cores // ranks),
                         timeout_s=1800)
        seconds = max(r[0] for r in per_rank)
        rows.append((name, ranks, seconds, per_rank[0][1], max(r[2] for r in per_rank), max(r[3] for r in per_rank),
                     per_rank[0][4]))
        print(f"{name}: {seconds * 1e3:.0f} ms", file=sys.stderr, flush=True)

    cmd = " ".join(["python bench/hf.py", *(sys.argv[1:] if argv is None else argv)])
    base = rows[0][2]
    print("## Hugging Face transformers (tiny Llama, fwd+bwd)\n")
    print(f"`{cmd}` — the tiny Llama of `examples/hf_train.py`, T={tokens} byte tokens packed from the standard "
          f"library (files cut into documents of at most {args.max_doc_len}; `DataCollatorWithFlattening`), "
          f"{rows[0][6]} documents, fp32, {cores} CPU cores, torch threads per rank = cores / ranks, "
          f"median of {repeats} steps of the slowest rank. Peak RSS = the rank's process high-water mark; step "
          "memory = its growth over the RSS before the first step (activations, masks, gathered K/V).\n")
    print("| attention | ranks | step (ms) | vs sdpa | loss | peak RSS / rank (MB) | step memory / rank (MB) |")
    print("|---|---|---|---|---|---|---|")
    for name, ranks, seconds, loss, peak, grown, _ in rows:
        print(f"| {name} | {ranks} | {seconds * 1e3:.0f} | {base / seconds:.2f}x | {loss:.5f} | {peak:.0f} "
              f"| {grown:.0f} |")
    print()


if __name__ == "__main__":
    main()
