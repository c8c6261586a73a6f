"""Write a synthetic Qwen2.5-1.5B-shaped Q4_K_M GGUF: random weights, real file layout.

The shape is Qwen2.5-1.5B's (28 layers, hidden 1536, 12 query and 2 kv heads of 128, MLP
8960, qkv biases, a tied head, rope base 1e6); the vocabulary and tokenizer metadata are the
embedded SmolLM2's (49152 tokens), so that specdec and llama.cpp tokenize alike without a
download. The types follow llama.cpp's Q4_K_M mixture: Q4_K everywhere, Q6_K for the tied
embedding/head and for attn_v and ffn_down in the layers llama.cpp's `use_more_bits` picks
(the first and last eighths and every third layer between). Norms and biases stay F32.

    python scripts/make_synthetic_gguf.py /tmp/qwen2.5-1.5b-synthetic-q4_k_m.gguf

Speed and memory work then happen at a size users run (docs/ hold the figures).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import gguf
import numpy as np

from specdec.backends.native.gguf_encode import quantize_blocks
from specdec.gguf_file import gguf_file
from specdec.models import builtin_gguf_path

SHAPE = dict(layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=8960, context=32768, theta=1e6)
Q4_K, Q6_K, F32 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.F32


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the Q4_K_M layers whose attn_v and ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("output", help="the .gguf file to write")
    parser.add_argument("--layers", type=int, default=SHAPE["layers"], help="decoder layers (default 28)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        write(args.output, args.layers, np.random.default_rng(args.seed))
    except NotImplementedError as e:
        print(f"make_synthetic_gguf: {e} (gguf_encode.quantize_blocks)", file=sys.stderr)
        return 1
    print(f"wrote {args.output} in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    return 0


def write(path: str, layers: int, rng: np.random.Generator) -> None:
    s = SHAPE
    source = gguf_file(builtin_gguf_path("smollm2-135m"))
    tokens = source.meta("tokenizer.ggml.tokens").values()
    writer = gguf.GGUFWriter(path, "qwen2")
    _metadata(writer, source, tokens, layers)
    q, kv, h = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["hidden"]

    def matrix(name: str, n: int, k: int, qtype, scale: float = 1.0) -> None:
        w = (rng.standard_normal((n, k), dtype=np.float32) * (scale / math.sqrt(k))).astype(np.float32)
        writer.add_tensor(name, quantize_blocks(w, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, center: float) -> None:
        writer.add_tensor(name, (center + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), h, Q6_K, scale=4.0)  # tied: llama.cpp gives the head Q6_K
    vector("output_norm.weight", h, 1.0)
    for i in range(layers):
        more = Q6_K if use_more_bits(i, layers) else Q4_K
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", h, 1.0)
        vector(p + "ffn_norm.weight", h, 1.0)
        matrix(p + "attn_q.weight", q, h, Q4_K)
        matrix(p + "attn_k.weight", kv, h, Q4_K)
        matrix(p + "attn_v.weight", kv, h, more)
        for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            vector(p + f"{name}.bias", n, 0.0)
        matrix(p + "attn_output.weight", h, q, Q4_K)
        matrix(p + "ffn_gate.weight", s["ffn"], h, Q4_K)
        matrix(p + "ffn_up.weight", s["ffn"], h, Q4_K)
        matrix(p + "ffn_down.weight", h, s["ffn"], more)
        print(f"layer {i + 1}/{layers}", file=sys.stderr, end="\r")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _metadata(writer: gguf.GGUFWriter, source, tokens: list[str], layers: int) -> None:
    s = SHAPE
    writer.add_name("Qwen2.5 1.5B shape, synthetic weights")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_block_count(layers)
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["theta"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model(source.meta("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(source.meta("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in source.meta("tokenizer.ggml.token_type")])
    writer.add_token_merges(source.meta("tokenizer.ggml.merges").values())
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unknown", writer.add_unk_token_id), ("padding", writer.add_pad_token_id)):  # fmt: skip
        add(int(source.meta(f"tokenizer.ggml.{key}_token_id")))
    writer.add_add_bos_token(False)
    writer.add_chat_template(source.meta("tokenizer.chat_template"))


if __name__ == "__main__":
    sys.exit(main())
