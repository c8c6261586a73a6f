"""The native backend's architectures against transformers, on tiny random models: Llama 3
(scaled rope; tied and untied heads), Mistral (sliding window), Qwen2 (qkv bias), Qwen3
(q/k norms), Gemma 3 (local and global layers, their own rope bases, sandwich norms, `1 + w`,
embedding scale, GELU, query_pre_attn_scalar, final softcap) and Phi-3 (fused qkv, gate_up).

Prompts run longer than the sliding windows, through every attention path: prompt chunks
(SDPA), decode chains and token trees, on the numba kernel and the PyTorch fallback. Negative
controls show that the bound catches a wrong rope base, norm offset or window."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_tokenizer
from specdec import Engine
from specdec.backends.native.model.hf_config import hf_state
from specdec.backends.native.model.native_model import NativeModel
from specdec.errors import SpecdecError
from specdec.models import LoadedModel

WINDOW = 8
COMMON = {"vocab_size": 400, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          # large enough that attention is far from uniform
          "initializer_range": 0.15, "bos_token_id": 0, "eos_token_id": 1}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _config(kind: str):
    import transformers as t

    if kind == "llama3":
        return t.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
    if kind == "llama_tied":
        return t.LlamaConfig(**COMMON, tie_word_embeddings=True)
    if kind == "mistral":
        return t.MistralConfig(**COMMON, sliding_window=WINDOW)
    if kind == "qwen2":
        return t.Qwen2Config(**COMMON)
    if kind == "qwen3":
        return t.Qwen3Config(**COMMON, head_dim=24)
    if kind == "gemma3":
        return t.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters={"full_attention": {"rope_type": "default",
                                                                      "rope_theta": 10000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 50.0}},
                                  final_logit_softcapping=6.0)
    if kind == "phi3":
        return t.Phi3Config(**COMMON, pad_token_id=0)
    raise ValueError(kind)


ARCHS = ("llama3", "llama_tied", "mistral", "qwen2", "qwen3", "gemma3", "phi3")
_MODELS: dict = {}


def hf_model(kind: str):
    """A random fp32 transformers model of `kind`, its norms and biases randomized too (so a
    dropped bias or a wrong norm offset shows), and its head sharpened away from ties."""
    if kind not in _MODELS:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, value in model.named_parameters():
                if name.endswith("norm.weight"):  # gemma: around 0 (multiplier 1 + w); others around 1
                    base = 0.0 if kind == "gemma3" else 1.0
                    value.copy_(base + 0.3 * torch.randn(value.shape, generator=gen))
                elif name.endswith(".bias"):
                    value.copy_(0.5 * torch.randn(value.shape, generator=gen))
            model.get_output_embeddings().weight.mul_(1.0 if kind == "gemma3" else 4.0)
        _MODELS[kind] = model
    return _MODELS[kind]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 390, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def native_logits(native: NativeModel, ids: list[int], prompt: int = 13) -> torch.Tensor:
    """Logits of every token of `ids`: a prompt chunk (SDPA), then chains of 5, 1, 3 and 9
    tokens (the decode attention), so both paths run past the window."""
    seq = native.new_pool(max_length=128).new_sequence()
    out, at = [seq.prefill(ids[:prompt])], prompt
    for size in (5, 1, 3, 9, 1, 1):
        out.append(seq.forward(ids[at : at + size]))
        at += size
    return torch.cat(out + ([seq.forward(ids[at:])] if at < len(ids) else []))


@pytest.fixture(params=["kernel", "fallback"])
def kernels(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("SPECDEC_CPU_KERNELS", "fallback")
    return request.param


BOUND = 2e-4  # fp32 native vs transformers, max abs logit difference (logits are O(1..10))


@pytest.mark.parametrize("kind", ARCHS)
def test_fp32_logits_match_transformers(kind, kernels):
    model = hf_model(kind)
    ids = tokens(40, seed=3)
    expected = hf_logits(model, ids)
    got = native_logits(NativeModel.from_hf(model), ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < BOUND
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert expected.std() > 0.5  # logits far from flat, so the bound means something


def _wrong(kind: str) -> list[tuple[str, NativeModel]]:
    """Native models of `kind` with one convention broken each."""
    model = hf_model(kind)
    right = NativeModel.from_hf(model)
    cfg, state = right.config, hf_state(right.config.model_type, model.state_dict())
    out = []
    if cfg.sliding_window is not None:
        out.append(("no window", NativeModel(dataclasses.replace(cfg, sliding_window=None), state)))
    if cfg.rope_local_theta is not None:
        out.append(("global rope base on local layers",
                    NativeModel(dataclasses.replace(cfg, rope_local_theta=None), state)))
    if cfg.rope_inv_freq is not None:
        out.append(("unscaled rope", NativeModel(dataclasses.replace(cfg, rope_inv_freq=None), state)))
    if kind == "gemma3":
        out.append(("norms without 1 +", NativeModel(cfg, model.state_dict())))
        out.append(("default attention scale",
                    NativeModel(dataclasses.replace(cfg, attention_scale=None), state)))
        out.append(("no embedding scale", NativeModel(dataclasses.replace(cfg, embedding_scale=1.0), state)))
    if cfg.qk_norm:
        flat = {**state, **{n: torch.ones_like(v) for n, v in state.items()
                            if n.endswith(("q_norm.weight", "k_norm.weight"))}}
        out.append(("q/k norm weights ignored", NativeModel(cfg, flat)))
    return out


@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen3", "gemma3"])
def test_the_bound_catches_a_broken_convention(kind):
    """Negative controls: each broken convention moves the logits far past BOUND."""
    model = hf_model(kind)
    ids = tokens(40, seed=3)
    expected = hf_logits(model, ids)
    wrong = _wrong(kind)
    assert wrong
    for what, native in wrong:
        assert (native_logits(native, ids) - expected).abs().max() > 50 * BOUND, what


def int4_weights(model):
    """A copy of `model` whose decoder linears hold what native int4 multiplies by: the int4
    round trip, scales and zeros rounded to bf16 as the kernel stores them (quant.Int4Linear)."""
    import copy

    from specdec.backends.native.kernels.precisions import quantize_int4

    model = copy.deepcopy(model)
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale, zero = quantize_int4(module.weight)  # [N, K], [N, G], [N, G]
                n, k = q.shape
                groups = (q.float() - 8).view(n, -1, 32) * scale.bfloat16().float()[..., None]
                module.weight.copy_((groups + zero.bfloat16().float()[..., None]).view(n, k))
    return model


@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_quantized_precisions_track_transformers(kind, precision):
    """Top-1 agreement and KL against transformers: on the same weights for bf16 and int8, on
    the int4 round trip of the weights for int4 (random weights lose too much to int4 for a
    bound against the fp32 model to say anything about the layers)."""
    model = hf_model(kind)
    reference = int4_weights(model) if precision == "int4" else model
    ids = tokens(40, seed=4)
    expected = torch.log_softmax(hf_logits(reference, ids).double(), -1)
    native = NativeModel.from_hf(model, precision)
    native.dense = None  # the prompt chunk through the quantized layers too, not the dense prompt layers
    got = torch.log_softmax(native_logits(native, ids).double(), -1)
    agreement = (got.argmax(-1) == expected.argmax(-1)).double().mean()
    kl = (expected.exp() * (expected - got)).sum(-1).mean()
    assert agreement >= 0.9 and kl < 0.02, (float(agreement), float(kl))


def _loaded(kind: str) -> LoadedModel:
    tok = tiny_tokenizer()
    return LoadedModel(name=f"tiny-{kind}", model=hf_model(kind), tokenizer=tok)


PROMPTS = ["def add(a, b): return a + b\ndef sub(a, b):",
           "The quick brown fox jumps over the lazy dog. The quick"]
# a random model's greedy text repeats itself by chance, and how much depends on the CPU's
# kernels: repetitive prompts make an accepted draft likely on every one (an AVX2 EPYC's phi3
# accepted none on the two above)
LOOPING_PROMPTS = ["one two three one two three one two", "a b c d a b c d a b"]


@pytest.mark.parametrize("path", ["kernel", pytest.param("fallback", marks=pytest.mark.slow)])
@pytest.mark.parametrize(("kind", "drafter"),
                         [(kind, ("ngram:min=1", "suffix")[i % 2]) for i, kind in enumerate(ARCHS)])
def test_speculation_reproduces_plain_greedy(kind, drafter, path, monkeypatch):
    """Over int4 (row-wise kernels, batch-invariant attention) speculation is lossless, bit for
    bit, with contexts well past the window (the PyTorch fallback's attention, slower: slow)."""
    if path == "fallback":
        monkeypatch.setenv("SPECDEC_CPU_KERNELS", "fallback")
    target, options = _loaded(kind), {"precision": "int4"}
    plain = Engine(target=target, drafter="none", backend="native", backend_options=options)
    spec = Engine(target=target, drafter=drafter, k=4, backend="native", backend_options=options)
    drafted = accepted = 0
    for prompt in PROMPTS + LOOPING_PROMPTS:
        result = spec.generate(prompt, max_new_tokens=40, chat=False)
        assert result.token_ids == plain.generate(prompt, max_new_tokens=40, chat=False).token_ids, prompt
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    assert drafted > 0 and accepted > 0, "nothing drafted or accepted: the test would pass vacuously"


TREE = [-1, 0, 0, 1, 1, 2, 3, 6, 7, 8, 9]  # branches, and a path deeper than the window


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.mark.parametrize("kind", ["mistral", "gemma3", "qwen3", "phi3"])
def test_tree_nodes_get_the_bits_of_plain_decoding(kind, kernels):
    """Each tree node, the deepest past the window, scores the bits of decoding its path one
    token per step; keep() then leaves the cache as those steps would."""
    native = NativeModel.from_hf(hf_model(kind), "int4")
    prefix, nodes, tail = tokens(11, seed=5), tokens(len(TREE), seed=6), tokens(3, seed=7)
    pool = native.new_pool(slots=2, max_length=64)
    tree, steps = pool.new_sequence(), pool.new_sequence()
    tree.prefill(prefix)
    logits = tree.forward_tree(nodes, TREE)
    deepest = max(range(len(TREE)), key=lambda i: len(_path(TREE, i)))
    for i in range(len(TREE)):
        steps.reset()
        steps.prefill(prefix)
        rows = torch.cat([steps.forward([nodes[j]]) for j in _path(TREE, i)])
        assert torch.equal(logits[i], rows[-1]), i
        if i == deepest:
            tree.keep(_path(TREE, i))
            assert torch.equal(tree.forward(tail), torch.cat([steps.forward([token]) for token in tail]))


def test_from_pretrained_reads_a_saved_directory(tmp_path):
    """A safetensors directory (gemma3: the `1 + w` norms, the nested rope settings) loads
    without transformers' model and gives from_hf's logits."""
    model = hf_model("gemma3")
    model.save_pretrained(str(tmp_path))
    ids = tokens(30, seed=8)
    expected = native_logits(NativeModel.from_hf(model), ids)
    # the same values; fp32 GEMMs over other allocations may round the last bits apart
    torch.testing.assert_close(native_logits(NativeModel.from_pretrained(tmp_path), ids), expected, rtol=0,
                               atol=1e-5)


def test_unsupported_features_are_refused_by_name():
    import transformers as t

    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    cases = [
        (t.Phi3Config(**COMMON, rope_parameters=longrope), "longrope"),
        (t.Phi3Config(**COMMON, partial_rotary_factor=0.5), "partial_rotary_factor"),
        (t.Gemma3TextConfig(**COMMON, attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (t.GPT2Config(), "'gpt2'"),
    ]
    from specdec.backends.native.model.config import NativeConfig

    for config, name in cases:
        with pytest.raises(SpecdecError, match=name):
            NativeConfig.from_hf(config)


@pytest.mark.slow
def test_real_gemma3_matches_transformers_and_speculates_exactly():
    """gemma3-270m (a real Q4_K_M): native fp32 logits against transformers' on the same
    dequantized weights, then ngram speculation reproducing plain greedy decoding, over int4
    and over the file's own quant types."""
    from specdec.backends.native.model.backend import HELDOUT_TEXT
    from specdec.models import load_model

    target = load_model("gemma3-270m")
    ids = target.tokenizer.encode(HELDOUT_TEXT)[:120]
    expected = hf_logits(target.model, ids)
    got = native_logits(NativeModel.from_hf(target.model), ids, prompt=40)
    assert (got - expected).abs().max() < 1e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    prompt = "List the days of the week, one per line: Monday, Tuesday, Wednesday, Thursday,"
    for options in ({"precision": "int4"}, {}):  # {}: the file's own types (Q5_0, Q4_K, Q6_K, Q8_0)
        plain = Engine(target=target, drafter="none", backend="native", backend_options=options)
        spec = Engine(target=target, drafter="ngram:min=1", k=4, backend="native", backend_options=options)
        result = spec.generate(prompt, max_new_tokens=48, chat=False)
        assert result.token_ids == plain.generate(prompt, max_new_tokens=48, chat=False).token_ids
        assert result.stats.num_accepted_tokens > 0


class _Lookup:
    """An embedding as a loader may pass it: a lookup object (as gguf/layers.QuantEmbedding)."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.num_embeddings, self.embedding_dim = table.shape

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden] fp32
        return self.table[token_ids].float()


@pytest.mark.parametrize("kind", ["llama_tied", "gemma3"])
def test_an_embedding_lookup_object_and_a_given_tied_head(kind):
    """A lookup object in place of the embedding tensor, with the tied head passed as
    lm_head.weight, gives the tensor path's logits; without lm_head.weight it is refused."""
    model = hf_model(kind)
    right = NativeModel.from_hf(model)
    state = hf_state(right.config.model_type, model.state_dict())
    embed = state["model.embed_tokens.weight"]
    ids = tokens(30, seed=9)
    lookup = NativeModel(right.config, {**state, "model.embed_tokens.weight": _Lookup(embed),
                                        "lm_head.weight": embed})
    assert torch.equal(native_logits(lookup, ids), native_logits(right, ids))
    untied = {n: v for n, v in state.items() if n != "lm_head.weight"}
    with pytest.raises(SpecdecError, match="lm_head.weight"):
        NativeModel(right.config, {**untied, "model.embed_tokens.weight": _Lookup(embed)})
