"""What llama.cpp charges to score n tokens in one batch after a context of c tokens: the
question of whether speculation could run on llama.cpp's kernels as its target backend.

    python scripts/bench/measure/llamacpp_batch_cost.py [--target smollm2-135m] [--threads 2]
        [--contexts 600] [--sizes 1,2,3,4,5,8,12,16,32] [--repeats 15]

Needs the `llamacpp` extra (llama-cpp-python). `--target` takes a GGUF file too. Prints, per
context, the median milliseconds of one batch of n tokens (llama_decode, logits for every
token), the prefill rate, and whether a batch's logits equal those of the same tokens fed one
at a time (a condition for greedy speculation to be bit-exact); ends with a JSON line (its
columns and rows: record.py's table, attention_cost.py's layout).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

ALONE = 16  # the widest batch checked against one-at-a-time logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="600")
    p.add_argument("--sizes", default="1,2,3,4,5,8,12,16,32")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    from llama_cpp import Llama

    from specdec.models import resolve

    kind, path = resolve(args.target)
    if kind != "gguf":
        raise SystemExit(f"{args.target} is not a GGUF model")
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [int(n) for n in args.sizes.split(",")]
    llm = Llama(model_path=str(path), n_ctx=max(4096, max(contexts) + max(sizes)), n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=512, verbose=False)  # fmt: skip
    ctx, batch, vocab = llm._ctx, llm._batch, llm.n_vocab()

    def feed(tokens: list[int], start: int) -> np.ndarray:  # logits [len(tokens), V]
        ctx.kv_cache_seq_rm(-1, start, -1)  # roll back to `start`, then append
        batch.set_batch(batch=tokens, n_past=start, logits_all=True)
        ctx.decode(batch)
        return np.ctypeslib.as_array(ctx.get_logits(), shape=(len(tokens), vocab)).copy()

    rng = np.random.default_rng(0)
    context_ids = rng.integers(100, 40000, max(contexts)).tolist()
    new = rng.integers(100, 40000, max(sizes)).tolist()
    report: dict = {"target": args.target, "threads": args.threads, "ms": {}, "same_logits": {}}
    for c in contexts:
        t0 = time.perf_counter()
        for start in range(0, c, 512):
            feed(context_ids[start : min(c, start + 512)], start)
        print(f"context {c}: prefill {c / (time.perf_counter() - t0):.0f} tok/s")
        alone = np.stack([feed([t], c + i)[0] for i, t in enumerate(new[:ALONE])])  # [ALONE, V]
        report["ms"][c], report["same_logits"][c] = {}, {}
        for n in sizes:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                logits = feed(new[:n], c)
                times.append(time.perf_counter() - t0)
            ms = report["ms"][c][n] = 1000 * float(np.median(times))
            one = report["ms"][c][sizes[0]]
            note = ""
            if n <= ALONE:
                same = report["same_logits"][c][n] = bool((logits == alone[:n]).all())
                note = f"  same logits as one at a time: {same}"
            print(f"n={n:2d}: {ms:6.1f} ms ({ms / one:.1f}x one token){note}", flush=True)
    report["columns"] = ["Context", *(f"{n} token{'s' * (n > 1)}" for n in sizes)]
    report["rows"] = [[c, *(f"{ms[n]:.1f} ({ms[n] / ms[sizes[0]]:.2f}x)"  # ≠: not one-at-a-time's logits
                            + ("" if report["same_logits"][c].get(n, True) else " ≠") for n in sizes)]
                      for c, ms in report["ms"].items()]  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
