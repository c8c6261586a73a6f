"""GGUF files read as they are: synthetic files of every architecture x quant type
(tests/gguf_factory.py) against the gguf package's reference and transformers' GGUF loader,
speculative decoding on them, memory after load, and the real gemma3-270m (slow)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_factory import ARCHS, K_QUANTS, QTYPES, llama3_rope_factors, spec_for, write_gguf
from specdec import Engine
from specdec import gguf_file as gguf_file_module
from specdec.backends import make_backend
from specdec.backends.auto import resolve_backend
from specdec.backends.native import quant_types
from specdec.backends.native.arch import llama as llama_arch
from specdec.backends.native.gguf.layers import runs_int8_activations
from specdec.backends.native.gguf.reader import read_gguf
from specdec.backends.native.kernels.int4_blocks import prompt_tiles
from specdec.backends.native.kernels.int8_ort import OrtBlockLinear8, ort_8bit_usable
from specdec.backends.native.kernels.kv_layout import keys_of
from specdec.backends.native.model import native_model
from specdec.backends.native.model.config import SUPPORTED_TYPES
from specdec.backends.native.model.native_model import NativeModel
from specdec.backends.native.quant_types import quant_type
from specdec.errors import SpecdecError
from specdec.gguf_file import MODEL_TYPES
from specdec.models import LoadedModel, load_model, load_tokenizer

VOCAB = 512  # synthetic files take SmolLM2's first 512 tokens (no merges) unless a test needs them all
TOKENS = [int(t) for t in np.random.default_rng(0).integers(3, VOCAB, 40)]
# native against transformers on the same file: a wrong rope, norm or row layout breaks these
# (see the mutation tests below); the per-type kernels may round activations (bf16), and the
# prompts multiply bf16 tiles of the weights: one more rounding, which flips a few of these
# random models' near-ties (KL stays ~3e-4, 30x under the bound a wrong layout breaks)
TOP1_MIN, KL_MAX = 0.9, 0.01
# Q8_0/Q5_K/Q6_K/Q5_0/Q5_1 multiply int8-quantized activations (as llama.cpp does: per block of
# 32, and per super-block of 256 for the K-quants, coarser), a larger rounding on these random
# models' flat logits; a wrong layout still lands above 10x the first and 5x the second
INT8_ACT_TOP1_MIN, INT8_ACT_KL_MAX, Q8_K_ACT_KL_MAX = 0.85, 0.03, 0.06


def _bounds(qtype: str) -> tuple[float, float]:
    if qtype in ("Q6_K", "Q5_K"):
        return INT8_ACT_TOP1_MIN, Q8_K_ACT_KL_MAX
    return ((INT8_ACT_TOP1_MIN, INT8_ACT_KL_MAX) if runs_int8_activations(quant_type(qtype))
            else (TOP1_MIN, KL_MAX))


def _write(tmp_path_factory, arch: str, qtype: str, **changes) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp(f"{arch}-{qtype}") / f"{arch}-{qtype}.gguf"
    try:
        weights = write_gguf(path, spec_for(arch, qtype, **{"vocab": VOCAB, **changes}))
    except NotImplementedError as e:  # the K-quant encoders are written separately
        pytest.skip(f"no {qtype} encoder yet: {e}")
    return path, weights


def _needs_native(arch: str) -> None:
    model_type = "mistral" if arch == "mistral" else MODEL_TYPES[arch]
    if model_type not in SUPPORTED_TYPES:
        pytest.skip(f"the native layers do not run {model_type} yet (arch.SUPPORTED_TYPES)")


def _kl_top1(reference: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    lp, lq = reference.double().log_softmax(-1), got.double().log_softmax(-1)
    return (float((lp.exp() * (lp - lq)).sum(-1).mean()),
            float((reference.argmax(-1) == got.argmax(-1)).double().mean()))


def _transformers_logits(path: Path, tokens: list[int], inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from specdec.backends.hf import HFBackend

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    # transformers' GGUF loader does not read rope_freqs: give it the same frequencies
    if inv_freq is not None:
        model.model.rotary_emb.inv_freq = inv_freq.float()
        model.model.rotary_emb.original_inv_freq = inv_freq.float()
    return HFBackend(model).prefill(tokens)


def _native_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """Over an fp32 KV cache (not the default bf16), so that the bounds measure the weight kernels."""
    pool = NativeModel.from_gguf(path).new_pool(max_length=256, kv_dtype=torch.float32)
    return pool.new_sequence().prefill(tokens)


# ---- the reader --------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_reader_tensors_and_config_match_the_file(tmp_path_factory, arch, qtype):
    path, weights = _write(tmp_path_factory, arch, qtype)
    model = read_gguf(path)
    assert set(model.tensors) == set(weights)
    for name, expected in weights.items():  # q/k rows of llama files are back in transformers' layout
        tensor = model.tensors[name]
        if (len(tensor.shape) == 2 and name != "model.embed_tokens.weight"
                and not name.endswith("norm.weight")):
            assert tensor.qtype.name == qtype, name  # kept in the file's type
        np.testing.assert_array_equal(tensor.dequantize(), expected, err_msg=name)
    spec, config = spec_for(arch, qtype), model.config
    assert (config["num_layers"], config["num_heads"], config["num_kv_heads"], config["head_dim"]) == (
        spec.layers, spec.heads, spec.kv_heads, spec.head_dim)
    assert config["model_type"] == ("mistral" if arch == "mistral" else MODEL_TYPES[arch])
    assert config["vocab_size"] == VOCAB and config["qk_norm"] == (arch in ("qwen3", "gemma3"))
    if arch == "gemma3":
        assert config["layer_types"] == ("sliding_attention",) * 5 + ("full_attention",)
        assert config["sliding_window"] == 16 and config["rope_local_theta"] == 10000.0
        assert config["sandwich_norms"] and config["activation"] == "gelu_tanh"
        assert config["embedding_scale"] == pytest.approx(16.0) and config["attention_scale"] == 256**-0.5
    elif spec.window:
        assert (config["layer_types"] == ("sliding_attention",) * spec.layers
                and config["sliding_window"] == spec.window)
    else:
        assert "layer_types" not in config


def test_metadata_equals_the_gguf_packages_reader(tmp_path_factory):
    from gguf import GGUFReader

    path, _ = _write(tmp_path_factory, "qwen2", "Q8_0")
    ours = gguf_file_module.GGUFFile(path)
    fields = {k: f for k, f in GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(ours.metadata)
    for key, field in fields.items():
        value = ours.meta(key)
        value = value.values() if isinstance(value, gguf_file_module.StringArray) else value
        expected = field.contents()
        assert (list(value) if isinstance(value, np.ndarray) else value) == pytest.approx(expected), key


def test_unsupported_types_and_architectures_are_named(tmp_path_factory, monkeypatch):
    path, _ = _write(tmp_path_factory, "llama", "Q8_0")
    only_f32 = {ggml: qt for ggml, qt in quant_types.BY_GGML.items() if qt.name == "F32"}
    monkeypatch.setattr(quant_types, "BY_GGML", only_f32)  # a table without Q8_0
    with pytest.raises(SpecdecError, match=r"tensor '[\w.]+' has GGUF type Q8_0, "
                                           r"which the native backend does not read"):
        read_gguf(path)
    bad = path.with_name("bad.gguf")
    bad.write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(SpecdecError, match="GGUF"):
        read_gguf(bad)


def test_llama3_rope_freqs_give_transformers_llama3_frequencies(tmp_path_factory):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path, _ = _write(tmp_path_factory, "llama", "F32", llama3_rope=True)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=rope)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    got = torch.tensor(read_gguf(path).rope_inv_freq)
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=0)
    assert not torch.allclose(got, torch.tensor(1.0 / llama3_rope_factors(64, 10000.0)))  # a scaled rope


# ---- native against transformers ----------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", *K_QUANTS])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_logits_match_transformers_on_the_same_file(tmp_path_factory, arch, qtype):
    _needs_native(arch)
    path, _ = _write(tmp_path_factory, arch, qtype)
    kl, top1 = _kl_top1(_transformers_logits(path, TOKENS), _native_logits(path, TOKENS))
    top1_min, kl_max = _bounds(qtype)
    assert top1 >= top1_min and kl <= kl_max, (top1, kl)


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q5_1"), ("qwen2", "Q5_0"), ("gemma3", "Q5_0")])
def test_native_q5_logits_match_transformers(tmp_path_factory, arch, qtype):
    """Q5_0 / Q5_1 (llama.cpp's fallback where a row is no multiple of 256) on a few archs only."""
    test_native_logits_match_transformers_on_the_same_file(tmp_path_factory, arch, qtype)


def test_a_wrong_row_layout_breaks_the_bound(tmp_path_factory, monkeypatch):
    """The bound above can fail: llama's q/k rows left interleaved (the rope then pairs the
    wrong dimensions) and Llama 3's rope_freqs ignored are both far outside it."""
    path, _ = _write(tmp_path_factory, "llama", "Q8_0", llama3_rope=True)
    inv_freq = torch.tensor(read_gguf(path).rope_inv_freq)
    reference = _transformers_logits(path, TOKENS, inv_freq)
    kl, top1 = _kl_top1(reference, _native_logits(path, TOKENS))
    top1_min, kl_max = _bounds("Q8_0")
    assert top1 >= top1_min and kl <= kl_max
    gguf_file_module.open_gguf.cache_clear()
    monkeypatch.setattr(llama_arch, "unpermute_rows", lambda rows, n_head: rows)
    kl, top1 = _kl_top1(reference, _native_logits(path, TOKENS))
    assert kl > 10 * INT8_ACT_KL_MAX
    monkeypatch.undo()
    monkeypatch.setattr(llama_arch.Llama, "rope_tensors", ())  # rope_freqs read as an unknown tensor: refused
    with pytest.raises(SpecdecError, match="rope_freqs"):
        read_gguf(path)


@pytest.mark.parametrize(("qtype", "length"), [("Q4_1", 300), ("Q4_1", 270), ("Q8_0", 300), ("Q6_K", 270)])
def test_prompt_groups_give_the_bits_of_one_pass_per_chunk(tmp_path_factory, qtype, length):
    """A prefill runs consecutive chunks in one forward (each chunk its own causal row): the
    logits and the cache equal those of one forward per chunk, and of a prefix kept from an
    earlier prompt (the tiles' GEMM computes each row on its own). At 270 tokens the last chunk
    (14) is short and takes the decode kernels, in a forward of its own."""
    path, _ = _write(tmp_path_factory, "llama", qtype)
    model = NativeModel.from_gguf(path)
    if model.prompt_group_tokens is None:
        pytest.skip("this CPU's prompt GEMM gives a row different bits in different row counts: "
                    "one chunk a forward")
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, length)]

    def prefill(group_tokens: int, keep_from: list[int] | None = None):
        model.prompt_group_tokens = group_tokens
        pool = model.new_pool(max_length=512)
        seq = pool.new_sequence()
        keep = 0
        if keep_from is not None:  # an earlier prompt sharing 200 tokens: its first chunk is kept
            seq.prefill(keep_from)
            keep = 128
        logits = seq.prefill(tokens, keep=keep)
        return logits, torch.stack([keys_of(k[seq.slot], len(tokens))
                                    for k in pool.k])  # [layers, kv_heads, T, dim]

    grouped, cache = prefill(512)
    for group_tokens, keep_from in ((128, None), (256, None), (512, tokens[:200])):
        logits, other_cache = prefill(group_tokens, keep_from)
        assert torch.equal(logits, grouped[128 if keep_from else 0 :]), (group_tokens, keep_from is not None)
        assert torch.equal(other_cache, cache)


def test_a_short_chunk_takes_the_decode_kernels_and_a_warm_prefill_keeps_its_bits(tmp_path_factory):
    """A chunk of fewer than SHORT_CHUNK_ROWS tokens runs the decode stack (the decode kernels,
    not bf16 tiles): its logits differ from the prompt kernels' where those decode tiles (F32's
    fp32 products against bf16 tiles; the quantized types may run one kernel for both), and a
    prompt prefilled after a kept prefix, whose chunk is then whole, equals its cold prefill."""
    path, _ = _write(tmp_path_factory, "llama", "F32")
    model = NativeModel.from_gguf(path)
    assert model.short_chunk_rows == native_model.SHORT_CHUNK_ROWS > 12
    tokens = [int(t) for t in np.random.default_rng(2).integers(3, VOCAB, 200)]

    def prefill(prompt: list[int], short_rows: int, keep_from: list[int] | None = None) -> torch.Tensor:
        model.short_chunk_rows = short_rows
        seq = model.new_pool(max_length=256).new_sequence()
        if keep_from is not None:
            seq.prefill(keep_from)
        return seq.prefill(prompt, keep=128 if keep_from is not None else 0)

    routed, tiled = prefill(tokens[:140], native_model.SHORT_CHUNK_ROWS), prefill(tokens[:140], 0)
    assert torch.equal(routed[:128], tiled[:128])  # the whole chunk: the prompt kernels either way
    if prompt_tiles():
        assert not torch.equal(routed[128:], tiled[128:])  # the short one: another kernel
    assert (routed[128:].argmax(-1) == tiled[128:].argmax(-1)).float().mean() >= 0.9
    cold = prefill(tokens, native_model.SHORT_CHUNK_ROWS)
    warm = prefill(tokens, native_model.SHORT_CHUNK_ROWS, keep_from=tokens[:140])
    assert torch.equal(warm, cold[128:])


def test_prompts_take_one_chunk_a_forward_where_the_gemm_rows_are_not_independent(tmp_path_factory,
                                                                                  monkeypatch):
    path, _ = _write(tmp_path_factory, "llama", "Q4_0")
    monkeypatch.setattr(native_model, "gemm_rows_independent", lambda dtype, k, n: False)
    assert NativeModel.from_gguf(path).prompt_group_tokens is None
    monkeypatch.setattr(native_model, "gemm_rows_independent", lambda dtype, k, n: True)
    assert NativeModel.from_gguf(path).prompt_group_tokens == native_model.PROMPT_GROUP_TOKENS
    assert NativeModel.from_gguf(path, precision="fp32").prompt_group_tokens is None


# ---- decoding ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer("smollm2-135m")  # the synthetic files carry its vocabulary (or its first 512 ids)


def _exact(target: LoadedModel, drafter: str, options: dict | None = None) -> int:
    plain = Engine(target=target, drafter="none", backend="native", backend_options=options or {})
    spec = Engine(target=target, drafter=drafter, k=4, backend="native", backend_options=options or {})
    accepted = 0
    for start in (0, 7):
        prompt = TOKENS[start : start + 12]
        result = spec.generate(prompt, max_new_tokens=40, chat=False)
        assert result.token_ids == plain.generate(prompt, max_new_tokens=40, chat=False).token_ids
        accepted += result.stats.num_accepted_tokens
    return accepted


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_decoding_is_exact_on_each_file(tmp_path_factory, smollm2_tokenizer, arch, qtype):
    _needs_native(arch)
    path, _ = _write(tmp_path_factory, arch, qtype)
    target = LoadedModel(path.name, tokenizer=smollm2_tokenizer, gguf_path=path)
    # random weights rarely repeat, so the model drafts for itself: k-token chains verified
    # against one-token steps, every draft accepted
    assert _exact(target, f"model:{path.name}") > 0
    assert not target.model_loaded  # the native path never built a transformers model


def test_an_ort8_head_speculates_exactly(tmp_path_factory, smollm2_tokenizer):
    if not ort_8bit_usable():
        pytest.skip("onnxruntime is not installed, or its 8-bit kernel is not batch-invariant here")
    path, _ = _write(tmp_path_factory, "llama", "Q8_0")
    target = LoadedModel(path.name, tokenizer=smollm2_tokenizer, gguf_path=path)
    assert _exact(target, f"model:{path.name}", {"lm_head": "ort8"}) > 0
    assert isinstance(make_backend("native", target, lm_head="ort8").pool.model.lm_head.layer,
                      OrtBlockLinear8)


def test_a_bf16_kv_cache_is_exact_too(tmp_path_factory, smollm2_tokenizer):
    path, _ = _write(tmp_path_factory, "llama", "Q8_0")
    target = LoadedModel(path.name, tokenizer=smollm2_tokenizer, gguf_path=path)
    assert _exact(target, f"model:{path.name}", {"kv_dtype": "bf16"}) > 0
    assert make_backend("native", target, kv_dtype="bf16").pool.k.dtype == torch.bfloat16
    with pytest.raises(SpecdecError, match="unknown kv_dtype"):
        make_backend("native", target, kv_dtype="int3")


def test_a_draft_file_drafts_for_a_target_file_on_the_native_path(tmp_path_factory, smollm2_tokenizer,
                                                                  monkeypatch):
    """Two files, one model: the target at Q8_0, its Q4_0 sibling as the draft (model:FILE)."""
    target_path, _ = _write(tmp_path_factory, "llama", "Q8_0")
    draft_path, _ = _write(tmp_path_factory, "llama", "Q4_0")
    monkeypatch.setattr("specdec.drafters.draft_model.load_model",
                        lambda name: LoadedModel(name, tokenizer=smollm2_tokenizer, gguf_path=Path(name)))
    target = LoadedModel(target_path.name, tokenizer=smollm2_tokenizer, gguf_path=target_path)
    engine = Engine(target=target, drafter=f"model:{draft_path}", k=4, backend="native")
    assert type(engine.drafter.backend).__name__ == "NativeSequence"
    assert engine.drafter.backend.pool.model.precision == "gguf"
    assert _exact(target, f"model:{draft_path}") > 0


# ---- loading -------------------------------------------------------------------------------------


def test_load_model_reads_the_tokenizer_and_facts_without_weights(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    path, _ = _write(tmp_path_factory, "qwen2", "Q8_0", vocab=None)  # the whole vocabulary and merges
    loaded = load_model(str(path))
    assert not loaded.model_loaded and loaded.gguf_path == path
    assert loaded.model_type == "qwen2" and loaded.vocab_size == 49152 and loaded.max_length == 2048
    assert loaded.eos_token_ids == {2, 0}  # the file's eos (<|im_end|>) and qwen's <|endoftext|>
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.tokenizer.encode("Hello world") == load_tokenizer("smollm2-135m").encode("Hello world")
    make_backend("native", loaded).prefill([1, 2, 3])
    assert not loaded.model_loaded and not (cache / "models").exists()  # no fp32 safetensors on this path
    assert (cache / "tokenizers").is_dir()  # the converted tokenizer, for the next load


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_picks_native_for_each_architecture_or_says_why_not(tmp_path_factory, arch, caplog):
    path, _ = _write(tmp_path_factory, arch, "Q8_0")
    model_type = "mistral" if arch == "mistral" else MODEL_TYPES[arch]
    with caplog.at_level(logging.WARNING, logger="specdec"):
        chosen = resolve_backend("auto", str(path))
    assert chosen == ("native" if model_type in SUPPORTED_TYPES else "hf")
    assert ("using the hf backend" in caplog.text) == (chosen == "hf")


# ---- the real gemma3-270m ------------------------------------------------------------------------


@pytest.mark.slow
def test_real_gemma3_270m_loads_natively_and_decodes():
    from specdec.models import builtin_gguf_path

    path = builtin_gguf_path("gemma3-270m")
    try:
        read_gguf(path)
    except SpecdecError as e:
        pytest.skip(f"the native backend does not read this file yet: {e.message}")
    if "gemma3_text" not in SUPPORTED_TYPES:
        pytest.skip("the native layers do not run gemma3 yet")
    target = load_model("gemma3-270m")
    engine = Engine(target=target, drafter="ngram", k=4, backend="native")
    plain = Engine(target=target, drafter="none", backend="native")
    prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    result = engine.generate(prompt, max_new_tokens=32, chat=False)
    assert result.token_ids == plain.generate(prompt, max_new_tokens=32, chat=False).token_ids
    assert "madrid" in result.text.lower() and not target.model_loaded


@pytest.mark.slow
def test_smollm2_q4_0_drafts_for_smollm2_q8_0_exactly(tmp_path_factory, smollm2_tokenizer, monkeypatch):
    """The embedded model re-encoded into two files (our own encoders): a Q8_0 target and a
    Q4_0 draft (model:FILE), both on the native path; speculative equals plain greedy. Both
    files keep the embedded model's tokenizer, so they share its loaded copy (reading each
    file's own is test_load_model_reads_the_tokenizer_and_facts_without_weights's part)."""
    from gguf_factory import requantize_gguf
    from specdec.models import builtin_gguf_path

    folder = tmp_path_factory.mktemp("smollm2")
    for qtype in ("Q8_0", "Q4_0"):
        requantize_gguf(builtin_gguf_path("smollm2-135m"), folder / f"smollm2-{qtype}.gguf", qtype)
    monkeypatch.setattr("specdec.drafters.draft_model.load_model",
                        lambda name: LoadedModel(name, tokenizer=smollm2_tokenizer, gguf_path=Path(name)))
    path = folder / "smollm2-Q8_0.gguf"
    target = LoadedModel(path.name, tokenizer=smollm2_tokenizer, gguf_path=path)
    plain = Engine(target=target, drafter="none", backend="native")
    spec = Engine(target=target, drafter=f"model:{folder / 'smollm2-Q4_0.gguf'}", k=4, backend="native")
    assert spec.drafter.backend.pool.model.precision == "gguf"
    accepted = 0
    for prompt in ("List three uses of a hash map.", "Write a Python function that reverses a string."):
        result = spec.generate(prompt, max_new_tokens=48)
        assert result.token_ids == plain.generate(prompt, max_new_tokens=48).token_ids, prompt
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0 and not target.model_loaded
