"""Plain greedy decoding on one GGUF file: specdec's native backend against llama.cpp, in turns.

    python scripts/bench/measure/decode_vs_llamacpp.py [--target FILE_OR_NAME] [--threads 2] [--runs 3]
        [--tokens 64] [--prompt 32]

Both in one process on the same file and thread count (torch and numba threads; llama.cpp's
n_threads), each driven at its lowest level, so that the figure is the decode step and not a
server: a `--prompt`-token prefill, then `--tokens` steps of one token, each the argmax of the
previous step's logits. Only the steps are timed. The runners alternate (specdec, llama.cpp,
specdec, ...) for `--runs` rounds; prints tok/s per run and ends with a JSON line (medians,
the ratio, and whether the two chose the same tokens: they need not, the kernels differ).
Needs the `llamacpp` extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def specdec_runner(target: str, threads: int, length: int):
    from specdec.backends import make_backend
    from specdec.models import load_model

    torch.set_num_threads(threads)  # the native backend's numba kernels follow torch's count
    seq = make_backend("native", load_model(target), prefix_cache="off", max_length=length)

    def run(prompt: list[int], steps: int) -> tuple[list[int], float]:
        seq.rollback(0)
        token = int(seq.prefill(prompt, all_logits=False)[-1].argmax())
        out, start = [token], time.perf_counter()
        for _ in range(steps - 1):
            token = int(seq.forward([token])[-1].argmax())
            out.append(token)
        return out, time.perf_counter() - start

    return run


def llamacpp_runner(path: str, threads: int, length: int):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=max(length, 512), n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)  # fmt: skip
    ctx, batch, vocab = llm._ctx, llm._batch, llm.n_vocab()

    def step(tokens: list[int], start: int) -> int:  # the argmax of the last token's logits
        batch.set_batch(batch=tokens, n_past=start, logits_all=False)
        ctx.decode(batch)
        return int(np.ctypeslib.as_array(ctx.get_logits(), shape=(vocab,)).argmax())

    def run(prompt: list[int], steps: int, model=llm) -> tuple[list[int], float]:  # model: keeps the context alive
        ctx.kv_cache_seq_rm(-1, 0, -1)
        token = step(prompt, 0)
        out, start = [token], time.perf_counter()
        for i in range(steps - 1):
            token = step([token], len(prompt) + i)
            out.append(token)
        return out, time.perf_counter() - start

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m", help="a GGUF file or built-in name")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3, help="rounds, each runner once per round")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per run (the first from the prefill)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before the timed steps")
    args = p.parse_args()
    from specdec.models import resolve

    path = str(resolve(args.target)[1])
    length = args.prompt + args.tokens + 1
    runners = {"specdec native": specdec_runner(args.target, args.threads, length),
               "llama.cpp": llamacpp_runner(path, args.threads, length)}  # fmt: skip
    prompt = np.random.default_rng(0).integers(100, 10000, args.prompt).tolist()
    for run in runners.values():  # warm-up: first-call compiles and page faults
        run(prompt, 4)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    tokens: dict[str, list[int]] = {}
    for i in range(args.runs):
        for name, run in runners.items():
            tokens[name], seconds = run(prompt, args.tokens)
            rates[name].append((args.tokens - 1) / seconds)
            print(f"round {i + 1} {name}: {rates[name][-1]:.2f} tok/s", flush=True)
    median = {name: statistics.median(r) for name, r in rates.items()}
    ours, theirs = median["specdec native"], median["llama.cpp"]
    same = sum(a == b for a, b in zip(tokens["specdec native"], tokens["llama.cpp"], strict=True))
    print(json.dumps({
        "target": args.target, "threads": args.threads, "runs": args.runs, "tokens": args.tokens,
        "rates": {name: [round(r, 2) for r in rs] for name, rs in rates.items()},
        "columns": ["Runner", "Decode tok/s (median)", "Runs", "Relative to llama.cpp"],
        "rows": [["specdec native", f"{ours:.2f}", " ".join(f"{r:.2f}" for r in rates["specdec native"]),
                  f"**{ours / theirs:.2f}x**"],
                 ["llama.cpp", f"{theirs:.2f}", " ".join(f"{r:.2f}" for r in rates["llama.cpp"]), "1.00x"]],
        "same_greedy_tokens": f"{same}/{args.tokens}",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
