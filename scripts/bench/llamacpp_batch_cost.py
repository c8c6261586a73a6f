"""What llama.cpp charges to score n tokens in one batch, after a 600-token context: the
question of whether speculation could run on llama.cpp's kernels as its target backend.

    python scripts/bench/llamacpp_batch_cost.py [--target smollm2-135m] [--threads 2]

Needs the `llamacpp` extra (llama-cpp-python). Prints the median milliseconds of one batch of
n tokens for n = 1..32, the prefill rate, and whether a batch's logits equal those of the
same tokens fed one at a time (a condition for greedy speculation to be bit-exact).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from llama_cpp import Llama

    from specdec.models import resolve

    kind, path = resolve(args.target)
    if kind != "gguf":
        raise SystemExit(f"{args.target} is not a GGUF model")
    llm = Llama(model_path=str(path), n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, verbose=False)
    ctx, batch, vocab = llm._ctx, llm._batch, llm.n_vocab()

    def feed(tokens: list[int], start: int) -> np.ndarray:  # logits [len(tokens), V]
        ctx.kv_cache_seq_rm(-1, start, -1)  # roll back to `start`, then append
        batch.set_batch(batch=tokens, n_past=start, logits_all=True)
        ctx.decode(batch)
        return np.ctypeslib.as_array(ctx.get_logits(), shape=(len(tokens), vocab)).copy()

    rng = np.random.default_rng(0)
    context = rng.integers(100, 40000, 600).tolist()
    t0 = time.perf_counter()
    feed(context[:512], 0)
    print(f"prefill: {512 / (time.perf_counter() - t0):.0f} tok/s (512 tokens)")
    feed(context[512:], 512)
    new = rng.integers(100, 40000, 32).tolist()
    alone = np.stack([feed([t], 600 + i)[0] for i, t in enumerate(new[:16])])  # [16, V]
    one = None
    for n in (1, 2, 3, 4, 5, 8, 12, 16, 32):
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            logits = feed(new[:n], 600)
            times.append(time.perf_counter() - t0)
        ms = 1000 * float(np.median(times))
        one = one or ms
        same = "" if n > 16 else f"  same logits as one at a time: {bool((logits == alone[:n]).all())}"
        print(f"n={n:2d}: {ms:6.1f} ms ({ms / one:.1f}x one token){same}")


if __name__ == "__main__":
    main()
