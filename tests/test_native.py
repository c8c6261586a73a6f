"""The native backend against transformers on tiny random Llamas: logits, rollback, batched
slots, quantized layers, GGUF reading and lossless greedy engine output (trees and compiled
models: test_native_trees.py)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from specdec import Engine, SpecdecError
from specdec.backends import forward_batch, make_backend
from specdec.backends.hf import HFBackend
from specdec.backends.native.model.config import NativeConfig
from specdec.backends.native.model.native_model import NativeModel, prompt_precision

TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def model(target):
    return NativeModel.from_hf(target.model)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_logits(model: NativeModel, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    seq = model.new_pool().new_sequence()
    seq.prefill(prefix)
    return seq.forward(tokens)


# ---- agreement with transformers -------------------------------------------------------------


@pytest.mark.parametrize(("prefix", "chunks"), [(1, []), (9, [1, 1, 1]), (6, [4, 1, 7]), (12, [2, 9])])
def test_logits_match_transformers(target, prefix, chunks):
    tokens = random_tokens(prefix + sum(chunks), seed=prefix)
    hf, native = HFBackend(target.model), make_backend("native", target, precision="fp32")
    torch.testing.assert_close(native.prefill(tokens[:prefix]), hf.prefill(tokens[:prefix]), **TOL)
    at = prefix
    for size in chunks:
        torch.testing.assert_close(native.forward(tokens[at : at + size]), hf.forward(tokens[at : at + size]),
                                   **TOL)
        at += size
    assert native.length == hf.length == at


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_other_llama_family_models_match_transformers(kind):
    """Qwen2 adds q/k/v biases; Mistral a sliding window, which masks older keys and no longer
    caps the context (past the window: test_native_arch.py)."""
    import transformers

    common = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    if kind == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        config, cls = (transformers.MistralConfig(**common, sliding_window=128),
                       transformers.MistralForCausalLM)
    torch.manual_seed(0)
    hf_model = cls(config).eval()
    if kind == "qwen2":
        with torch.no_grad():
            for layer in hf_model.model.layers:  # random biases, so a dropped one would show
                layer.self_attn.q_proj.bias.normal_()
                layer.self_attn.k_proj.bias.normal_()
    native = NativeModel.from_hf(hf_model).new_pool().new_sequence()
    assert native.max_length == 256
    tokens = random_tokens(12, seed=8)
    hf = HFBackend(hf_model)
    torch.testing.assert_close(native.prefill(tokens[:9]), hf.prefill(tokens[:9]), **TOL)
    torch.testing.assert_close(native.forward(tokens[9:]), hf.forward(tokens[9:]), **TOL)


@pytest.mark.parametrize(("prefix", "junk", "keep"), [(7, 5, 3), (12, 1, 0), (1, 8, 8), (5, 4, 4)])
def test_forward_after_rollback_equals_fresh_forward(model, prefix, junk, keep):
    tokens = random_tokens(prefix + junk + 6, seed=prefix)
    tail = tokens[prefix + junk :]
    seq = model.new_pool().new_sequence()
    seq.prefill(tokens[:prefix])
    seq.forward(tokens[prefix : prefix + junk])  # tokens that will be rejected
    seq.rollback(prefix + keep)
    assert seq.length == prefix + keep
    expected = fresh_logits(model, tokens[: prefix + keep], tail)
    torch.testing.assert_close(seq.forward(tail), expected, **TOL)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_explicit_device_matches_transformers(target, device):
    tokens = random_tokens(10, seed=3)
    native = make_backend("native", target, device=device, precision="fp32")
    expected = HFBackend(target.model).prefill(tokens)
    torch.testing.assert_close(native.prefill(tokens), expected, **TOL)  # logits come back on the cpu


# ---- batched slots ---------------------------------------------------------------------------


def test_batched_forward_matches_one_by_one(model):
    prefixes = [random_tokens(n, seed=n) for n in (3, 10, 1, 7)]
    steps = [random_tokens(n, seed=50 + n) for n in (1, 4, 0, 6)]
    pool = model.new_pool(slots=4, max_length=64)
    seqs = [pool.new_sequence() for _ in prefixes]
    assert pool.free_slots == 0
    prefill = pool.forward_batch(seqs, prefixes)  # prompts of different lengths in one pass
    out = forward_batch(seqs, steps)  # the generic entry point dispatches to the pool
    for prefix, step, seq, first, second in zip(prefixes, steps, seqs, prefill, out, strict=True):
        torch.testing.assert_close(first, fresh_logits(model, [], prefix), **TOL)
        assert second.shape == (len(step), model.config.vocab_size)
        if step:
            torch.testing.assert_close(second, fresh_logits(model, prefix, step), **TOL)
        assert seq.length == len(prefix) + len(step)
    seqs[1].rollback(5)  # slots roll back independently
    torch.testing.assert_close(seqs[1].forward([9]), fresh_logits(model, prefixes[1][:5], [9]), **TOL)
    torch.testing.assert_close(seqs[0].forward([9]), fresh_logits(model, prefixes[0] + steps[0], [9]), **TOL)


@pytest.mark.parametrize("precision", ["int4", "fp32"])
@pytest.mark.parametrize("unscored", [[[0], [1, 2], []], [[0], [0], [0, 1, 2, 3]]],
                         ids=["some", "whole-sequences"])
def test_unscored_rows_skip_the_lm_head_and_leave_the_others_as_they_were(target, precision, unscored):
    """forward_batch's `unscored` rows (a grammar allows one token there) come back as zeros;
    every other row has the bits of a forward that scored them all. An fp32 head's GEMM rounds
    a row by the rows around it, so there every row is scored."""
    model = NativeModel.from_hf(target.model, precision)
    prefixes, steps = ([random_tokens(n, seed=n) for n in (3, 5, 2)],
                       [random_tokens(n, seed=70 + n) for n in (1, 3, 4)])
    pool = model.new_pool(slots=3, max_length=32)
    seqs = [pool.new_sequence() for _ in prefixes]
    pool.forward_batch(seqs, prefixes)
    full = forward_batch(seqs, steps)
    for seq, prefix in zip(seqs, prefixes, strict=True):
        seq.rollback(len(prefix))
    part = forward_batch(seqs, steps, unscored)
    for rows, a, b in zip(unscored, full, part, strict=True):
        kept = [i for i in range(a.shape[0]) if i not in rows or precision == "fp32"]
        assert torch.equal(b[kept], a[kept]) and b.shape == a.shape
        assert not b[rows].any() if precision == "int4" else b[rows].all()
    assert [s.length for s in seqs] == [len(p) + len(t) for p, t in zip(prefixes, steps, strict=True)]


def test_bf16_kv_cache_tracks_fp32(model):
    tokens = random_tokens(14, seed=6)
    seq = model.new_pool(kv_dtype=torch.bfloat16).new_sequence()
    seq.prefill(tokens[:10])
    expected = fresh_logits(model, tokens[:10], tokens[10:])
    torch.testing.assert_close(seq.forward(tokens[10:]), expected, rtol=0.05, atol=0.05)


def test_last_only_logits(model):
    pool = model.new_pool(slots=3)
    seqs = [pool.new_sequence() for _ in range(3)]
    prompts = [random_tokens(5, seed=1), [], random_tokens(9, seed=2)]
    out = pool.forward_batch(seqs, prompts, last_only=True)
    assert [o.shape[0] for o in out] == [1, 0, 1]
    torch.testing.assert_close(out[2][0], fresh_logits(model, [], prompts[2])[-1], **TOL)
    last = seqs[0].prefill(prompts[2], all_logits=False)
    torch.testing.assert_close(last, out[2], **TOL)
    assert seqs[0].length == 9


def test_slots_are_released_and_reused(model):
    pool = model.new_pool(slots=2, max_length=16)
    a, b = pool.new_sequence(), pool.new_sequence()
    with pytest.raises(SpecdecError, match="slots are in use"):
        pool.new_sequence()
    pool.release(a)
    with pytest.raises(ValueError, match="released"):
        a.forward([1])
    c = pool.new_sequence()
    c.prefill([5, 6])
    b.prefill([7])
    torch.testing.assert_close(c.forward([8]), fresh_logits(model, [5, 6], [8]), **TOL)


# ---- the engine ------------------------------------------------------------------------------


_HF_GREEDY: dict = {}


def hf_greedy(target, prompt: str) -> list[int]:
    if prompt not in _HF_GREEDY:
        engine = Engine(target=target, drafter="none", backend="hf")
        _HF_GREEDY[prompt] = engine.generate(prompt, max_new_tokens=32, chat=False).token_ids
    return _HF_GREEDY[prompt]


@pytest.mark.parametrize("drafter", ["none", "ngram:min=1", "perfect"])
def test_engine_greedy_native_equals_transformers(target, drafter):
    prompts = ["def add(a, b):", "The quick brown fox", '{"name": "search"']
    fp32 = {"precision": "fp32"}
    if drafter == "perfect":  # the target drafts for itself on a native backend of its own device
        drafter = f"model:{target.name}:backend=native:device=cpu:precision=fp32"
    native = Engine(target=target, drafter=drafter, k=4, backend="native", backend_options=fp32)
    drafted = accepted = 0
    for prompt in prompts:
        result = native.generate(prompt, max_new_tokens=32, chat=False)
        assert result.token_ids == hf_greedy(target, prompt), prompt
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    if drafter == "none":
        assert drafted == 0
    else:
        assert accepted > 0, "nothing was accepted: the test would pass vacuously"
    if drafter == "perfect":
        assert accepted == drafted


@pytest.mark.parametrize("precision", ["int8", "int4", "bf16"])
def test_quantized_scoring_is_batch_invariant(target, precision):
    """The int8/int4/bf16 kernels compute each row on its own and attention is batch-invariant
    (attention.py), so scoring k tokens, alone or batched with other sequences, gives the very bits of
    k one-token steps (fp32 GEMM does not: it differs from GEMV by ~1e-6), and speculation
    over a quantized target reproduces its plain greedy output exactly."""
    options = {"precision": precision}
    tokens = random_tokens(28, seed=21)
    chain, steps = make_backend("native", target, **options), make_backend("native", target, **options)
    chain.prefill(tokens[:20])
    steps.prefill(tokens[:20])
    one_by_one = torch.cat([steps.forward([t]) for t in tokens[20:]])
    assert torch.equal(chain.forward(tokens[20:]), one_by_one)
    pool = chain.pool.model.new_pool(slots=2)
    a, b = pool.new_sequence(), pool.new_sequence()
    a.prefill(tokens[:20])
    b.prefill(tokens[3:9])
    assert torch.equal(pool.forward_batch([a, b], [tokens[20:], tokens[9:10]])[0], one_by_one)
    plain = Engine(target=target, drafter="none", backend="native", backend_options=options)
    spec = Engine(target=target, drafter="ngram:min=1", k=4, backend="native", backend_options=options)
    accepted = 0
    for prompt in ["def add(a, b):", "The quick brown fox"]:
        result = spec.generate(prompt, max_new_tokens=32, chat=False)
        assert result.token_ids == plain.generate(prompt, max_new_tokens=32, chat=False).token_ids
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_prompts_run_dense_and_never_share_a_pass_with_steps(target):
    """With a quantized precision, prompts (over 32 tokens) run dense layers (bf16 where the
    CPU multiplies bf16 natively, else fp32 over the same tensors), and a batch that mixes
    prompts and steps is split, so a step's bits never depend on what it was batched with."""
    tokens = random_tokens(60, seed=31)
    int4 = make_backend("native", target, precision="int4")
    # a model whose own layers and head are the int4 model's prompt layers and head
    reference = NativeModel.from_hf(target.model, prompt_precision(torch.device("cpu"), "int4"))
    reference.dense, reference.lm_head = None, int4.pool.model.dense[1]
    fp32 = reference.new_pool(kv_dtype=int4.pool.kv_dtype).new_sequence()  # (reference's default may differ)
    assert torch.equal(int4.prefill(tokens[:40]), fp32.prefill(tokens[:40]))
    alone = int4.forward(tokens[40:43])  # a step: int4 layers
    assert not torch.equal(alone, fp32.forward(tokens[40:43]))
    pool = int4.pool.model.new_pool(slots=2)
    a, b = pool.new_sequence(), pool.new_sequence()
    a.prefill(tokens[:40])
    mixed = pool.forward_batch([a, b], [tokens[40:43], tokens[5:45]])
    assert torch.equal(mixed[0], alone)
    assert torch.equal(mixed[1], fp32.prefill(tokens[5:45]))


@pytest.mark.parametrize("hidden", [False, True], ids=["kv", "kv+hidden"])
def test_a_forked_prefix_continues_with_the_bits_of_a_cold_prefill(target, hidden):
    """CachePool.fork copies a cached prefix (a shared system prompt) into a free slot: a prompt
    that shares it prefills from there with the logits and hidden states of a cold prefill, and
    the source keeps its own conversation."""
    shared = random_tokens(140, seed=41)  # past one chunk of 128: the prefix kept is 128 tokens
    ours, theirs = shared + random_tokens(25, seed=42), shared + random_tokens(30, seed=43)
    source = make_backend("native", target, precision="int8", slots=3)
    cold = source.pool.new_sequence()
    if hidden:
        source.enable_hidden_states()
        cold.enable_hidden_states()
    source.prefill(ours)
    keep = source.prefix_cache.cached_prefix(theirs)
    fork = source.pool.fork(source, keep)
    assert keep == 128 and fork.length == keep and source.pool.free_slots == 0  # source, cold, fork
    assert fork.prefix_cache.cached_prefix(theirs) == keep
    warm, expected = fork.prefill(theirs, keep=keep), cold.prefill(theirs)
    assert torch.equal(warm, expected[keep:])
    if hidden:
        assert torch.equal(fork.hidden, cold.hidden)
    assert source.length == len(ours) and source.prefix_cache.cached_prefix(ours + [5]) == 128
    with pytest.raises(ValueError, match="fork"):
        source.pool.fork(source, len(ours) + 1)


# ---- quantization ----------------------------------------------------------------------------


@pytest.mark.parametrize(("precision", "bound"), [
    ("bf16", 0.02),
    ("fp16", 0.002),
    ("int8", 0.05),
    ("int4", 0.3),
])
def test_quantized_backends_track_fp32(target, precision, bound):
    tokens = random_tokens(24, seed=9)
    full = make_backend("native", target, precision="fp32").prefill(tokens)
    quantized = make_backend("native", target, precision=precision).prefill(tokens)
    assert (quantized - full).norm() / full.norm() < bound


# ---- GGUF ------------------------------------------------------------------------------------


def write_tiny_gguf(loaded, path, quantized: bool) -> None:
    """Write a llama GGUF the way llama.cpp's converter does (Q/K rows permuted for rotary)."""
    import gguf

    cfg = loaded.model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, value in loaded.model.state_dict().items():
        w = value.detach().numpy()
        parts = key.split(".")
        if key.startswith("model.layers."):
            name = f"blk.{parts[2]}.{names[parts[-2]]}.weight"
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(parts[-2])
            if heads:
                w = w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[key]
        if quantized and name.startswith("blk.") and w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_matches_the_transformers_gguf_loader(target, tmp_path):
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(target, tmp_path / "tiny.gguf", quantized=True)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                     dtype=torch.float32)
    tokens = random_tokens(16, seed=11)
    expected = HFBackend(reference).prefill(tokens)
    native = NativeModel.from_gguf(tmp_path / "tiny.gguf", "fp32").new_pool().new_sequence()
    torch.testing.assert_close(native.prefill(tokens), expected, **TOL)
    # the default, the file's own types: the blocks as they are, bf16 or int8 activations
    own = NativeModel.from_gguf(tmp_path / "tiny.gguf").new_pool().new_sequence()
    assert (own.prefill(tokens) - expected).norm() / expected.norm() < 0.05
    # int4 keeps the Q4_1 blocks as they are: only bf16 rounding separates it from fp32
    int4 = NativeModel.from_gguf(tmp_path / "tiny.gguf", "int4").new_pool().new_sequence()
    assert (int4.prefill(tokens) - expected).norm() / expected.norm() < 0.05


def test_safetensors_directory_matches(target, tmp_path):
    target.model.save_pretrained(str(tmp_path))
    tokens = random_tokens(10, seed=12)
    native = NativeModel.from_pretrained(tmp_path).new_pool().new_sequence()
    torch.testing.assert_close(native.prefill(tokens), HFBackend(target.model).prefill(tokens), **TOL)


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "match"), [
    ({"precision": "fp8"}, "unknown precision"),
    ({"colour": "red"}, "unknown native backend option"),
    ({"max_length": 10_000}, "max_length must be"),
    ({"slots": 0}, "at least one slot"),
])
def test_bad_options_are_specdec_errors(target, options, match):
    with pytest.raises(SpecdecError, match=match):
        make_backend("native", target, **options)


def test_hf_backend_takes_no_options(target):
    with pytest.raises(SpecdecError, match="no options"):
        make_backend("hf", target, precision="int8")


def test_unsupported_architecture_is_refused():
    with pytest.raises(SpecdecError, match="use the hf backend"):
        NativeConfig.from_hf(types.SimpleNamespace(model_type="gpt2"))


def test_context_overflow_is_refused(model):
    seq = model.new_pool(max_length=16).new_sequence()
    seq.prefill(list(range(10)))
    with pytest.raises(ValueError, match="context overflow"):
        seq.forward(list(range(7)))
    with pytest.raises(ValueError, match="context overflow"):
        seq.forward_tree(list(range(7)), [-1] * 7)
    assert seq.length == 10


# ---- the real model --------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_native_greedy_equals_transformers(smollm2):
    native = Engine(target=smollm2, drafter="ngram", k=4, backend="native",
                    backend_options={"precision": "fp32"})
    hf = Engine(target=smollm2, drafter="none", backend="hf")
    accepted = 0
    for prompt in ["List three uses of a hash map.", "Write a Python function that reverses a string."]:
        result = native.generate(prompt, max_new_tokens=48)
        assert result.token_ids == hf.generate(prompt, max_new_tokens=48).token_ids, prompt
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_compare_precisions_reports_fp32_as_its_own_reference(target):
    from specdec.backends.native.model.backend import compare_precisions

    report = compare_precisions(target, "The quick brown fox jumps over the lazy dog. " * 2, ("int8",))
    assert report["fp32"]["top1_agreement"] == 1.0 and report["fp32"]["kl"] == 0.0
    assert 0.0 < report["int8"]["kl"] < 0.1 and report["int8"]["perplexity"] > 1.0
