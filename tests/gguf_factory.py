"""Small synthetic GGUF files for every native architecture and quant type (nothing downloaded).

`write_gguf(path, spec)` writes random weights the way llama.cpp's converter lays them out
(llama's Q/K rows interleaved for its rotary, gemma's norms stored as 1 + w, phi3's fused
qkv and gate|up), encoded by gguf/encode.quantize_blocks, with the embedded SmolLM2's
tokenizer metadata (a real 49k BPE vocabulary) and an architecture's chat template. It
returns the weights as a model would use them, in Hugging Face names and layout, so tests
can hold the reader to them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import gguf
import numpy as np

from specdec.backends.native.gguf.encode import quantize_blocks
from specdec.gguf_file import gguf_file
from specdec.models import builtin_gguf_path

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")  # mistral: a llama file with a window
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")

CHAT_TEMPLATES = {
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
               "{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "gemma3": ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
               "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "phi3": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
}
_TEMPLATE_OF = {"llama": "chatml", "mistral": "chatml", "qwen2": "chatml", "qwen3": "chatml",
                "gemma3": "gemma3", "phi3": "phi3"}


@dataclass(frozen=True)
class Spec:
    """One synthetic model. Matrices in `qtype` (K-quants need widths that are multiples of 256)."""

    arch: str = "llama"
    qtype: str = "Q8_0"
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 512
    tied: bool = False
    llama3_rope: bool = False  # write a rope_freqs tensor as llama.cpp does for Llama 3.x
    window: int | None = None  # sliding window (mistral, gemma3, phi3)
    seed: int = 0
    context: int = 2048
    vocab: int | None = None  # None: SmolLM2's whole tokenizer; N: its first N tokens, no merges (fast files)

    @property
    def gguf_arch(self) -> str:
        return "llama" if self.arch == "mistral" else self.arch


def spec_for(arch: str, qtype: str = "Q8_0", **changes) -> Spec:
    """Each architecture's typical shape: gemma3 with six layers (five sliding, one global) and
    head_dim 256 (transformers scales its queries by query_pre_attn_scalar, 256 by default)."""
    defaults = {"gemma3": {"layers": 6, "window": 16, "tied": True, "head_dim": 256},
                "mistral": {"window": 4096}, "phi3": {"window": 2047},
                "qwen3": {"tied": True, "head_dim": 128}}.get(arch, {})
    return Spec(arch=arch, qtype=qtype, **{**defaults, **changes})


@functools.cache
def tokenizer_fields() -> dict:
    """The embedded SmolLM2's tokenizer metadata (a gpt2-style BPE of 49152 tokens)."""
    f = gguf_file(builtin_gguf_path("smollm2-135m"))
    return {
        "tokens": f.meta("tokenizer.ggml.tokens").values(),
        "merges": f.meta("tokenizer.ggml.merges").values(),
        "token_type": [int(t) for t in f.meta("tokenizer.ggml.token_type")],
        "ids": {key: int(f.meta(f"tokenizer.ggml.{key}_token_id"))
                for key in ("bos", "eos", "unknown", "padding")},
    }


def llama3_rope_factors(head_dim: int, theta: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                        original: int = 64) -> np.ndarray:
    """llama.cpp's rope_freqs for a Llama 3 rope scaling: each frequency's divisor [head_dim / 2]."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    factors = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor,
                                                                 1.0 / ((1 - smooth) / factor + smooth)))
    return factors.astype(np.float32)


def _weights(spec: Spec, vocab: int) -> dict[str, np.ndarray]:
    """Random weights in HF names and layout; norms are the multipliers themselves."""
    rng = np.random.default_rng(spec.seed)

    def mat(n: int, k: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n, k)) * scale / math.sqrt(k)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    q, kv, h = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.hidden
    w = {"model.embed_tokens.weight": (rng.standard_normal((vocab, h)) * 0.5).astype(np.float32),
         "model.norm.weight": norm(h)}
    if not spec.tied:
        w["lm_head.weight"] = mat(vocab, h, 8.0)  # sharp logits: greedy choices far from ties
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
              p + "self_attn.q_proj.weight": mat(q, h, 2.0), p + "self_attn.k_proj.weight": mat(kv, h, 2.0),
              p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
              p + "mlp.gate_proj.weight": mat(spec.ffn, h), p + "mlp.up_proj.weight": mat(spec.ffn, h),
              p + "mlp.down_proj.weight": mat(h, spec.ffn)}
        if spec.arch == "qwen2":
            for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                w[p + f"self_attn.{name}.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        if spec.arch in ("qwen3", "gemma3"):
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = (norm(spec.head_dim),
                                                                                  norm(spec.head_dim))
        if spec.arch == "gemma3":
            w[p + "pre_feedforward_layernorm.weight"] = norm(h)
            w[p + "post_feedforward_layernorm.weight"] = norm(h)
    if spec.tied:  # the tied head reads the embedding: scale it so logits are sharp
        w["model.embed_tokens.weight"] *= 4.0 / math.sqrt(h)
    return w


_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(spec: Spec, key: str) -> str:
    base, leaf = key.rsplit(".", 1)
    if base in _TOP:
        return f"{_TOP[base]}.{leaf}"
    _, _, layer, rest = base.split(".", 3)
    names = {**_GGUF_NAMES, **(_GEMMA_NAMES if spec.arch == "gemma3" else {})}
    return f"blk.{layer}.{names[rest]}.{leaf}"


def _fused_phi3(w: dict, spec: Spec) -> dict:
    """phi3's layout: q|k|v in one matrix, gate|up in another."""
    out = {}
    for key, value in w.items():
        if ".self_attn.k_proj." in key or ".self_attn.v_proj." in key or ".mlp.up_proj." in key:
            continue
        if ".self_attn.q_proj." in key:
            p = key.split("self_attn")[0]
            out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
                [w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        elif ".mlp.gate_proj." in key:
            p = key.split("mlp")[0]
            out[p + "mlp.gate_up_proj.weight"] = np.concatenate([value, w[p + "mlp.up_proj.weight"]])
        else:
            out[key] = value
    return out


def _interleave_rows(w: np.ndarray, heads: int) -> np.ndarray:
    # transformers' (2, dim) rotary halves per head -> llama.cpp's (dim, 2) interleaving
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, spec: Spec) -> dict[str, np.ndarray]:
    """Write `spec` to `path`; return the weights the file decodes to (HF names, fp32)."""
    tok = tokenizer_fields()
    if spec.vocab is not None:
        tok = {**tok, "tokens": tok["tokens"][: spec.vocab], "token_type": tok["token_type"][: spec.vocab],
               "merges": []}
    weights = _weights(spec, len(tok["tokens"]))
    if spec.arch == "phi3":
        weights = _fused_phi3(weights, spec)
    qtype = gguf.GGMLQuantizationType[spec.qtype]
    writer = gguf.GGUFWriter(str(path), spec.gguf_arch)
    _write_metadata(writer, spec, tok)
    decoded = {}
    for key, value in weights.items():
        name, data = gguf_name(spec, key), value
        if spec.gguf_arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            data = _interleave_rows(value, spec.heads if ".attn_q." in name else spec.kv_heads)
        if value.ndim == 2:
            raw = quantize_blocks(data, qtype)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            decoded[key] = _decode(raw, qtype, value.shape, spec.gguf_arch == "llama" and data is not value,
                                   spec.heads if ".attn_q." in name else spec.kv_heads)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
            decoded[key] = value
    if spec.llama3_rope:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(spec.head_dim, _theta(spec)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


def _decode(raw: np.ndarray, qtype, shape, interleaved: bool, heads: int) -> np.ndarray:
    floats = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)
    if interleaved:  # back to the HF layout
        floats = floats.reshape(heads, floats.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(shape)
    return floats


def _theta(spec: Spec) -> float:
    return 1_000_000.0 if spec.arch == "gemma3" else 10_000.0


def _write_metadata(writer: gguf.GGUFWriter, spec: Spec, tok: dict) -> None:
    writer.add_name("synthetic mistral" if spec.arch == "mistral" else f"synthetic {spec.arch}")
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(_theta(spec))
    writer.add_vocab_size(len(tok["tokens"]))
    if spec.window:
        writer.add_sliding_window(spec.window)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["token_type"])
    if tok["merges"]:
        writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["ids"]["bos"])
    writer.add_eos_token_id(tok["ids"]["eos"])
    writer.add_unk_token_id(tok["ids"]["unknown"])
    writer.add_pad_token_id(tok["ids"]["padding"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATES[_TEMPLATE_OF[spec.arch]])


def requantize_gguf(source, path, qtype: str) -> None:
    """A llama GGUF (the embedded SmolLM2) re-encoded: every matrix dequantized by the gguf
    package and encoded again in `qtype`, the rest (rows as laid out, metadata) as it is."""
    f = gguf_file(source)
    arch = f.meta("general.architecture")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{f.meta('general.name')} {qtype}")
    keys = ("block_count", "context_length", "embedding_length", "feed_forward_length",
            "attention.head_count", "attention.head_count_kv", "rope.dimension_count", "vocab_size")
    for key in keys:
        writer.add_uint32(f"{arch}.{key}", int(f.meta(f"{arch}.{key}")))
    writer.add_float32(f"{arch}.rope.freq_base", float(f.meta(f"{arch}.rope.freq_base")))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon",
                       float(f.meta(f"{arch}.attention.layer_norm_rms_epsilon")))
    tok = tokenizer_fields()
    writer.add_tokenizer_model(f.meta("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(f.meta("tokenizer.ggml.pre"))
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["token_type"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["ids"]["bos"])
    writer.add_eos_token_id(tok["ids"]["eos"])
    writer.add_unk_token_id(tok["ids"]["unknown"])
    writer.add_pad_token_id(tok["ids"]["padding"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(f.meta("tokenizer.chat_template"))
    target = gguf.GGMLQuantizationType[qtype]
    for name, tensor in f.tensors.items():
        if len(tensor.shape) == 2:
            writer.add_tensor(name, quantize_blocks(tensor.dequantize(), target), raw_dtype=target)
        else:
            writer.add_tensor(name, np.ascontiguousarray(tensor.dequantize()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
