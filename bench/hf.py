"""A transformers Llama on packed documents: HF's sdpa vs doccp attention vs doccp CP, side by side.

The tiny Llama of examples/hf_train.py (2 layers, hidden 64, 4 query / 2 KV heads, byte
vocabulary), one forward + backward per step on T tokens packed from the standard library's
``.py`` files (``DataCollatorWithFlattening``):

- one process, transformers' ``sdpa`` with its packed-sequence mask (a dense ``[T, T]`` mask);
- one process, ``attn_implementation="doccp"`` on the batch as it is (documents from ``position_ids``,
  no mask);
- one process, the same through ``shard_batch`` (a plan of one rank, as a CP job of one runs it);
- 2 CP ranks, doccp attention on ``shard_batch``'s shards.

Time per step: median over repeats, of the slowest rank. Memory per rank: the peak RSS of the
process (``ru_maxrss``; every configuration runs in fresh processes), and its growth over the RSS
just before the first step, which is the step's working memory (activations, masks, gathered K/V)
without the interpreter, libraries and weights. RSS, not tracemalloc: torch allocates outside
Python's allocator. Torch threads per rank = cores / ranks.

    python bench/hf.py            # T=16384
    python bench/hf.py --quick    # T=4096, fewer repeats

``--device cuda`` runs the one-process configurations on one GPU instead, and transformers'
``flex_attention`` (its document BlockMask) beside them, with a larger Llama
(4 layers, hidden 2048, 16 query / 4 KV heads of 128, bf16) and T=32768 by default: step time is
CUDA-synchronised wall time, memory is the GPU's (``torch.cuda.max_memory_allocated``: the peak,
and its growth over the memory allocated before the first step). CP needs a GPU per rank, so the
CP row is left out there.
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

from doccp.launch import WorkerError, spawn

#: (row, attn_implementation, ranks, through shard_batch)
CONFIGS = [("HF sdpa (packed-sequence mask)", "sdpa", 1, False), ("doccp attention", "doccp", 1, False),
           ("doccp attention via shard_batch", "doccp", 1, True), ("doccp CP", "doccp", 2, True)]
#: On a GPU: one process each, and transformers' FlexAttention too (a document BlockMask built from
#: ``position_ids`` every step; compiled in the warm-up steps). CP needs a GPU per rank.
CUDA_CONFIGS = [CONFIGS[0], ("HF flex_attention (document BlockMask)", "flex_attention", 1, False), *CONFIGS[1:3]]


def rss_mb() -> float:
    """Resident set size now (Linux /proc), in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


#: The models: the tiny Llama of examples/hf_train.py on the CPU, a larger one (head_dim 128) on a GPU.
MODELS = {"cpu": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2),
          "cuda": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                       num_key_value_heads=4)}


def run(rank: int, attn: str, shard: bool, tokens: int, max_doc_len: int, repeats: int, device: str = "cpu"
        ) -> tuple[float, float, float, float, int]:
    """Median step time, loss, peak memory (RSS, or the GPU's), its growth over the memory before
    the first step, and the document count."""
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

    import doccp.hf
    from doccp.app.corpus import pack, scan, stdlib_dir

    doccp.hf.register()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, use_cache=False, attn_implementation=attn,
                                         **MODELS[device]))
    packed = pack(scan(stdlib_dir(), "*.py"), tokens, max_doc_len, seed=0)
    documents = packed.tokens.split(packed.layout.lengths.tolist())
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in documents])
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        model = model.to("cuda", torch.bfloat16)
        batch = {key: value.cuda() for key, value in batch.items()}

    def step() -> float:
        inputs = doccp.hf.shard_batch(batch) if shard else batch
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        if distributed:
            doccp.hf.all_reduce_gradients(model)
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        return float(loss.detach())

    before = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mb()
    loss = step()
    step()  # warm-up
    times = []
    for _ in range(repeats):
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        step()  # its loss is read on the host: the step has finished on the GPU too
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
    return statistics.median(times), loss, peak, peak - before, packed.layout.num_docs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T=4096, fewer repeats")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 16384; quick 4096)")
    ap.add_argument("--max-doc-len", type=int, default=1024, help="files longer than this are cut into documents")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: one GPU, a larger model in bf16, the one-process rows (module docstring)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA device")
    tokens = args.tokens or (4096 if args.quick else 32768 if cuda else 16384)
    repeats = args.repeats or (2 if args.quick else 5)
    cores = os.cpu_count() or 1
    rows, failed = [], {}
    for name, attn, ranks, shard in CUDA_CONFIGS if cuda else CONFIGS:
        try:
            per_rank = spawn(run, ranks, attn, shard, tokens, args.max_doc_len, repeats, args.device,
                             threads=max(1, cores // ranks), timeout_s=1800)
        except WorkerError as e:
            if name == CONFIGS[0][0]:
                raise  # the baseline every ratio needs
            failed[name] = str(e).splitlines()[0]
            print(f"{name}: failed: {failed[name]}", file=sys.stderr, flush=True)
            continue
        seconds = max(r[0] for r in per_rank)
        rows.append((name, ranks, seconds, per_rank[0][1], max(r[2] for r in per_rank), max(r[3] for r in per_rank),
                     per_rank[0][4]))
        print(f"{name}: {seconds * 1e3:.0f} ms", file=sys.stderr, flush=True)

    cmd = " ".join(["python bench/hf.py", *(sys.argv[1:] if argv is None else argv)])
    base = rows[0][2]
    packing = (f"T={tokens} byte tokens packed from the standard library (files cut into documents of at most "
               f"{args.max_doc_len}; `DataCollatorWithFlattening`), {rows[0][6]} documents")
    if cuda:
        print("## Hugging Face transformers on a GPU (Llama, 4 layers, hidden 2048, fwd+bwd)\n")
        print(f"`{cmd}` — {torch.cuda.get_device_name(0)}, torch {torch.__version__}: a Llama of 4 layers, hidden "
              f"2048, 16 query / 4 KV heads of 128, bf16, {packing}, median of {repeats} steps. Peak = "
              "`torch.cuda.max_memory_allocated`; step memory = its growth over the memory allocated before the "
              "first step (activations, masks, gradients).\n")
    else:
        print("## Hugging Face transformers (tiny Llama, fwd+bwd)\n")
        print(f"`{cmd}` — the tiny Llama of `examples/hf_train.py`, {packing}, fp32, {cores} CPU cores, torch threads "
              f"per rank = cores / ranks, median of {repeats} steps of the slowest rank. Peak RSS = the rank's process "
              "high-water mark; step memory = its growth over the RSS before the first step (activations, masks, "
              "gathered K/V).\n")
    memory = "GPU memory" if cuda else "RSS"
    print(f"| attention | ranks | step (ms) | vs sdpa | loss | peak {memory} / rank (MB) | step memory / rank (MB) |")
    print("|---|---|---|---|---|---|---|")
    for name, ranks, seconds, loss, peak, grown, _ in rows:
        print(f"| {name} | {ranks} | {seconds * 1e3:.0f} | {base / seconds:.2f}x | {loss:.5f} | {peak:.0f} "
              f"| {grown:.0f} |")
    for name, reason in failed.items():
        print(f"| {name} | 1 | failed: {reason} | | | | |")
    print()


if __name__ == "__main__":
    main()
