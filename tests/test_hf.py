"""doccp.hf: transformers models (built from configs, no download) under doccp CP equal one process
running transformers' own sdpa attention; the refusals; the Trainer path."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from oracle import dense_attention  # noqa: E402

import doccp  # noqa: E402
import doccp.hf  # noqa: E402
from doccp.launch import spawn  # noqa: E402

VOCAB = 97
#: Awkward documents: 1-token ones, ones shorter than 2N, T=65 divisible by neither 2 nor 3.
LENGTHS = [1, 13, 2, 30, 7, 1, 11]
ONE_DOC = [23]  # one document spanning the whole stream
TOL = {"logits": 1e-4, "loss": 1e-5, "grads": 2e-5}


def config(kind: str, attn: str, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation=attn)
    if kind == "llama":
        return transformers.LlamaConfig(**common, **extra)
    if kind == "qwen2":  # hybrid: layer 0 full attention, layer 1 a sliding window of 5
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                        **extra)
    if kind == "mistral":  # every layer a sliding window of 4
        return transformers.MistralConfig(**common, sliding_window=4, **extra)
    raise ValueError(kind)


MODELS = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
          "mistral": transformers.MistralForCausalLM}


def build(kind: str, attn: str, state=None, **extra):
    torch.manual_seed(0)
    model = MODELS[kind](config(kind, attn, **extra)).float()
    if state is not None:
        model.load_state_dict(state)
    return model


def batch(lengths: list[int], seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(VOCAB, (n,), generator=gen).tolist()} for n in lengths]
    return transformers.DataCollatorWithFlattening()(features)


def reference(kind: str, lengths: list[int]):
    """One process, transformers' sdpa with its packed-sequence mask: logits, loss, gradients."""
    model = build(kind, "sdpa")
    out = model(**batch(lengths))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return model.state_dict(), out.logits.detach()[0], out.loss.detach(), grads


CASES = [(kind, lengths) for kind in MODELS for lengths in (LENGTHS, ONE_DOC)]


def cp_worker(rank: int, world_size: int, states: dict, trainer_dir: str) -> dict:
    doccp.hf.register()
    group = torch.distributed.group.WORLD
    results = {}
    for kind, lengths in CASES:
        model = build(kind, "doccp", states[kind, tuple(lengths)])
        local = doccp.hf.shard_batch(batch(lengths), group=group)
        out = model(**local)
        out.loss.backward()
        doccp.hf.all_reduce_gradients(model, group)
        loss = out.loss.detach().clone()
        torch.distributed.all_reduce(loss)  # the ranks' losses are parts of one sum
        logits = doccp.unshard(out.logits.detach()[0], local.plan, group)
        results[kind, tuple(lengths)] = (logits, loss, {n: p.grad for n, p in model.named_parameters()})
    results["refusals"] = refusals(rank)
    if world_size == 2:  # the Trainer path, in the same spawned group
        for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 2), ("LOCAL_WORLD_SIZE", 2)):
            os.environ[name] = str(value)  # how accelerate learns of a group it did not set up
        results["trainer"] = train(doccp.hf.CPTrainer, "doccp", 2, trainer_dir)
    return results


def train(trainer_class, attn: str, per_device: int, output_dir: str) -> tuple[list[float], dict]:
    """Three Trainer steps on packed samples: the logged losses and the weights after them."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 40, (24,), generator=gen).tolist()
    samples = [{"input_ids": torch.randint(VOCAB, (n,), generator=gen).tolist()} for n in lengths]
    args = transformers.TrainingArguments(output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=3,
                                          logging_steps=1, learning_rate=3e-3, use_cpu=True, report_to=[],
                                          save_strategy="no", seed=0, disable_tqdm=True)
    model = build("llama", attn)
    trainer = trainer_class(model=model, args=args, train_dataset=samples,
                            data_collator=transformers.DataCollatorWithFlattening())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def refusals(rank: int) -> dict:
    """Under a 2+ rank group: an unsharded batch raises on every rank, different batches across
    the CP ranks raise, and a declared data-parallel-only setup attends locally."""
    found = {}
    model = build("llama", "doccp")
    try:
        model(**batch(LENGTHS))
    except ValueError as e:
        found["unsharded"] = str(e)
    try:
        doccp.hf.shard_batch(batch(LENGTHS, seed=rank))
    except ValueError as e:
        found["different"] = str(e)
    doccp.hf.register("doccp_dp_only", allow_local=True)
    model.set_attn_implementation("doccp_dp_only")
    found["dp_only_logits"] = model(**batch(LENGTHS, seed=rank)).logits.detach()[0]
    return found


@pytest.fixture(scope="module")
def references():
    return {(kind, tuple(lengths)): reference(kind, lengths) for kind, lengths in CASES}


@pytest.mark.parametrize("world_size", [2, 3])
def test_cp_equals_one_process_sdpa(references, world_size, tmp_path):
    states = {key: ref[0] for key, ref in references.items()}
    per_rank = spawn(cp_worker, world_size, world_size, states, str(tmp_path), timeout_s=300)
    for key, (_, logits, loss, grads) in references.items():
        for rank_result in per_rank:
            cp_logits, cp_loss, cp_grads = rank_result[key]
            torch.testing.assert_close(cp_logits, logits, atol=TOL["logits"], rtol=TOL["logits"], msg=str(key))
            torch.testing.assert_close(cp_loss, loss, atol=TOL["loss"], rtol=TOL["loss"], msg=str(key))
            assert grads.keys() == cp_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(cp_grads[name], grad, atol=TOL["grads"], rtol=TOL["grads"],
                                           msg=f"{key} {name}")
    for rank, rank_result in enumerate(per_rank):
        found = rank_result["refusals"]
        assert "without a doccp plan" in found["unsharded"] and f"{world_size} ranks" in found["unsharded"]
        assert "different batches" in found["different"]
        # data parallelism only: each rank's own batch, attended locally, equals sdpa on that batch
        ref = build("llama", "sdpa")(**batch(LENGTHS, seed=rank)).logits.detach()[0]
        torch.testing.assert_close(found["dp_only_logits"], ref, atol=1e-5, rtol=1e-5)
    if world_size == 2:
        # CPTrainer on 2 CP ranks, 2 samples each, equals one process's plain Trainer (sdpa) on 4
        losses, weights = train(transformers.Trainer, "sdpa", 4, str(tmp_path / "one"))
        for cp_losses, cp_weights in (r["trainer"] for r in per_rank):
            assert len(cp_losses) == len(losses) == 3
            torch.testing.assert_close(torch.tensor(cp_losses), torch.tensor(losses), atol=1e-5, rtol=1e-5)
            for name, w in weights.items():
                torch.testing.assert_close(cp_weights[name], w, atol=2e-5, rtol=2e-5, msg=name)


def test_one_process_equals_sdpa(references):
    """Without CP (no torch.distributed), doccp attention is a packed-sequence attention."""
    doccp.hf.register()
    for (kind, lengths), (state, logits, loss, _) in references.items():
        out = build(kind, "doccp", state)(**batch(list(lengths)))
        torch.testing.assert_close(out.logits.detach()[0], logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.loss.detach(), loss, atol=1e-6, rtol=1e-6)


def test_shard_batch_one_process():
    full = batch(LENGTHS)
    local = doccp.hf.shard_batch(full)
    assert local.plan.world_size == 1 and local["use_cache"] is False
    torch.testing.assert_close(local["input_ids"], full["input_ids"])
    torch.testing.assert_close(local["position_ids"], full["position_ids"])
    expected = torch.cat([full["labels"][0, 1:], torch.tensor([-100])])  # HF's own shift, on the full stream
    torch.testing.assert_close(local["shift_labels"][0], expected)
    assert local["num_items_in_batch"] == int((expected != -100).sum()) == sum(LENGTHS) - len(LENGTHS)
    assert isinstance(local[doccp.hf.PLAN_KWARG], doccp.hf.BatchPlan)
    # cu_seq_lens only (flash-attention kwargs), position ids from the plan
    cu = transformers.DataCollatorWithFlattening(return_position_ids=False, return_flash_attn_kwargs=True)(
        [{"input_ids": [1] * n} for n in LENGTHS])
    local = doccp.hf.shard_batch(cu)
    assert local["position_ids"][0].tolist() == [i for n in LENGTHS for i in range(n)]
    assert "cu_seq_lens_q" not in local and "max_length_k" not in local


def test_shard_batch_bad_input():
    full = batch(LENGTHS)
    with pytest.raises(TypeError, match="mapping"):
        doccp.hf.shard_batch([full["input_ids"]])
    with pytest.raises(ValueError, match="needs 'input_ids'"):
        doccp.hf.shard_batch({"position_ids": full["position_ids"]})
    with pytest.raises(ValueError, match=r"one packed stream \[1, T\]"):
        doccp.hf.shard_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    with pytest.raises(ValueError, match="position_ids.*or 'cu_seq_lens_q'"):
        doccp.hf.shard_batch({"input_ids": full["input_ids"]})
    with pytest.raises(ValueError, match="padding tokens"):
        doccp.hf.shard_batch({**full, "attention_mask": torch.zeros_like(full["input_ids"])})
    with pytest.raises(ValueError, match="disagree"):
        doccp.hf.shard_batch({**full, "cu_seq_lens_q": torch.tensor([0, 5, sum(LENGTHS)], dtype=torch.int32)})


def test_refuses_dropout_softcap_padding_and_cache():
    doccp.hf.register()
    model = build("llama", "doccp", attention_dropout=0.1)
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        model(**batch(LENGTHS))
    model.eval()  # no dropout in eval mode: runs
    assert model(**batch(LENGTHS)).logits.shape == (1, sum(LENGTHS), VOCAB)

    torch.manual_seed(0)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, attn_logit_softcapping=50.0, use_cache=False))
    gemma.set_attn_implementation("doccp")
    with pytest.raises(ValueError, match="softcapping"):
        gemma(**batch(LENGTHS))

    with pytest.raises(ValueError, match="padding tokens"):
        model(input_ids=torch.ones(1, 6, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="KV cache"):
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False, use_cache=True)


class Layer(torch.nn.Module):
    """A stand-in attention module: what the attention function reads from the layer."""

    def __init__(self, is_causal: bool, chunk: int | None = None):
        super().__init__()
        self.is_causal, self.layer_idx = is_causal, 0
        if chunk is not None:  # Llama 4's chunked-attention layers
            self.config = type("Config", (), {"layer_types": ["chunked_attention"], "attention_chunk_size": chunk})()


@pytest.mark.parametrize(("is_causal", "window", "chunk", "mask"), [
    (True, None, None, doccp.Mask.causal()),
    (True, 3, None, doccp.Mask.sliding_window(2)),  # HF's window counts the query itself: kv > q - W
    (False, None, None, doccp.Mask.full()),
    (True, None, 4, doccp.Mask.chunked(4)),
])
def test_attention_function_matches_oracle(is_causal, window, chunk, mask):
    assert doccp.hf.layer_mask(Layer(is_causal, chunk), window) == mask
    layout = doccp.DocLayout.from_lengths(LENGTHS)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, layout.num_tokens, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    positions = layout.positions().unsqueeze(0)
    out, weights = doccp.hf.attention.attention_forward(Layer(is_causal, chunk), q, k, v, None, scaling=0.3,
                                                        sliding_window=window, position_ids=positions)
    assert weights is None and out.shape == (1, layout.num_tokens, 4, 8)
    expected, _ = dense_attention(*(x[0].transpose(0, 1) for x in (q, k, v)), layout, mask, scale=0.3)
    torch.testing.assert_close(out[0], expected)


def test_layer_mask_refuses_bidirectional_windows():
    with pytest.raises(ValueError, match="bidirectional"):
        doccp.hf.layer_mask(Layer(False), 4)
    with pytest.raises(ValueError, match="positive int"):
        doccp.hf.layer_mask(Layer(True), 0)
