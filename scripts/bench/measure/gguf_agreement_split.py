"""Where does specdec's disagreement with llama.cpp on a GGUF come from? Pairwise top-1
agreement and mean KL among four engines on the same file and the same tokens:

    python scripts/bench/measure/gguf_agreement_split.py [--file smollm2-135m] [--min-tokens 500]
        [--threads 1]

- `llama16`: llama.cpp as it runs by default (f16 KV cache), the greedy tokens' source;
- `llama32`: llama.cpp with an f32 KV cache, fed the same tokens one at a time;
- `gguf`: specdec's native backend at the file's own types (its decode kernels);
- `fp32`: specdec over the file dequantized exactly (the gguf package's decoder), fp32 layers.

`fp32->gguf` is the error of specdec's kernels alone; `llama16->fp32` that of llama.cpp's own
arithmetic (8-bit activations in its quantized dot products, the f16 cache) plus any model
difference (rope, norms, template); `llama16->llama32` the cache's share. The prompts and
files are gguf_agreement.py's. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_agreement as agreement  # noqa: E402

PAIRS = (("llama16", "gguf"), ("llama16", "fp32"), ("fp32", "gguf"), ("llama32", "fp32"), ("llama32", "gguf"),
         ("llama16", "llama32"))  # fmt: skip


def kl_sum(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", default="smollm2-135m", choices=agreement.FILES)
    p.add_argument("--min-tokens", type=int, default=500)
    p.add_argument("--max-new", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", type=Path, default=Path("~/.cache/specdec/requant").expanduser())
    args = p.parse_args()
    from llama_cpp import Llama

    from specdec.backends import make_backend
    from specdec.models import load_model

    torch.set_num_threads(args.threads)
    path = agreement.file_path(args.file, args.cache_dir, args.threads)
    loaded = load_model("gemma3-270m" if args.file == "gemma3-270m" else str(path))

    def llama(**kv) -> Llama:
        return Llama(model_path=str(path), n_ctx=512, n_threads=args.threads, n_threads_batch=args.threads,
                     n_batch=512, logits_all=True, verbose=False, **kv)

    llm16, llm32 = llama(), llama(type_k=agreement.GGML_TYPE_F32, type_v=agreement.GGML_TYPE_F32)
    eos = {llm16.token_eos(), *loaded.eos_token_ids}
    seqs = {precision: make_backend("native", loaded, prefix_cache="off", precision=precision, max_length=512)
            for precision in ("gguf", "fp32")}  # fmt: skip
    runs, _ = agreement.greedy_runs(llm16, loaded.tokenizer, args, eos)
    agree, kl, positions = dict.fromkeys(PAIRS, 0), dict.fromkeys(PAIRS, 0.0), 0
    for i, prompt, tokens, _ in runs:
        _, llama16 = agreement.llama_greedy(llm16, prompt, len(tokens), eos)
        logits = {"llama16": llama16, "llama32": agreement.llama_decode(llm32, prompt, tokens)}
        for name, seq in seqs.items():
            logits[name] = agreement.specdec_logits(seq, prompt, tokens, 1)
        positions += len(tokens)
        for a, b in PAIRS:
            agree[a, b] += int((logits[a].argmax(-1) == logits[b].argmax(-1)).sum())
            kl[a, b] += kl_sum(logits[a], logits[b])
        print(f"prompt {i}: {positions} positions", file=sys.stderr, flush=True)
    out = {f"{a}->{b}": {"top1": round(agree[a, b] / positions, 4), "mean_kl": float(f"{kl[a, b] / positions:.3g}")}
           for a, b in PAIRS}  # fmt: skip
    print(json.dumps({"file": path.name, "positions": positions, "threads": args.threads, **out}))


if __name__ == "__main__":
    main()
