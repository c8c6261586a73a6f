"""Write a synthetic Qwen2.5-1.5B-shaped Q4_K_M GGUF: random weights, the embedded
SmolLM2-135M's tokenizer (so that specdec and llama.cpp tokenize alike), for speed and memory
work at a size users run (issue 25, item 6).

    python scripts/bench/synthetic_qwen2_gguf.py OUT.gguf [--layers 28] [--hidden 1536] [--ffn 8960]

Architecture `qwen2` (q/k/v biases, tied embeddings), 12 heads of 128 with 2 kv heads at the
default size. Types follow llama.cpp's Q4_K_M mix: Q4_K for the matrices, Q6_K for the tied
embedding (it is the output) and for attn_v / ffn_down in the layers llama.cpp gives more
bits (the first and last eighth, and every third between), F32 for norms and biases. The
K-quants are encoded by specdec's gguf_encode (min/max scales, not llama.cpp's search).
Weights are N(0, 0.02); norms are 1.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from specdec.backends.native.gguf.encode import quantize_blocks
from specdec.models import resolve

Q4_K, Q6_K, F32 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.F32
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.chat_template")  # fmt: skip


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def copy_tokenizer(writer: GGUFWriter, source: str) -> int:
    """The tokenizer fields of `source`'s GGUF into writer; returns the vocabulary size."""
    reader = GGUFReader(resolve(source)[1])
    fields = {key: reader.fields[key].contents() for key in TOKENIZER_KEYS if key in reader.fields}
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    for key, add in (("tokenizer.ggml.unknown_token_id", writer.add_unk_token_id),
                     ("tokenizer.ggml.padding_token_id", writer.add_pad_token_id),
                     ("tokenizer.ggml.add_bos_token", writer.add_add_bos_token),
                     ("tokenizer.chat_template", writer.add_chat_template)):  # fmt: skip
        if key in fields:
            add(fields[key])
    return len(fields["tokenizer.ggml.tokens"])


def write(path: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, seed: int,
          source: str = "smollm2-135m") -> None:  # fmt: skip
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "qwen2")
    writer.add_name("synthetic Qwen2.5-1.5B-shaped (random weights)")
    writer.add_block_count(layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(LLAMA_FTYPE_MOSTLY_Q4_K_M)
    writer.add_quantization_version(2)
    vocab = copy_tokenizer(writer, source)
    head_dim = hidden // heads

    def matrix(name: str, rows: int, cols: int, qtype: GGMLQuantizationType) -> None:  # [rows, cols] in torch order
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        writer.add_tensor(name, quantize_blocks(w, qtype), raw_dtype=qtype)

    def vector(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32), raw_dtype=F32)

    matrix("token_embd.weight", vocab, hidden, Q6_K)  # tied: it is also the output
    vector("output_norm.weight", np.ones(hidden))
    for i in range(layers):
        wide = Q6_K if more_bits(i, layers) else Q4_K
        vector(f"blk.{i}.attn_norm.weight", np.ones(hidden))
        vector(f"blk.{i}.ffn_norm.weight", np.ones(hidden))
        matrix(f"blk.{i}.attn_q.weight", heads * head_dim, hidden, Q4_K)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, Q4_K)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, wide)
        for part, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            vector(f"blk.{i}.attn_{part}.bias", rng.standard_normal(size * head_dim) * 0.02)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * head_dim, Q4_K)
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden, Q4_K)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden, Q4_K)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn, wide)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=8960)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    start = time.perf_counter()
    write(args.out, args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.seed)
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
