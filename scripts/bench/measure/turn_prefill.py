"""What an agent's next turn costs to read: N new prompt tokens after C cached ones, on the
native backend against llama-cpp-python on the same GGUF file, in turns, medians.

    python scripts/bench/measure/turn_prefill.py [--target smollm2-135m] [--cached 4000]
        [--new 256] [--rounds 5] [--threads 2]

specdec keeps what its prefix cache allows (in the default, bit-exact mode: the cached tokens
down to the 128-token chunk grid, so a few are read again) and prefills the rest, as the
server does for a conversation's next turn. llama-cpp-python (default flags, `n_threads`,
`n_ctx` the cached and new tokens) keeps all C tokens and evaluates the N new ones. Both read
the same token ids. Prints a line per round and ends with a JSON line for record.py.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from specdec.backends import make_backend
from specdec.models import load_model


def specdec_turn(seq, prompt: list[int], cached: int) -> float:
    seq.prefill(prompt[:cached], all_logits=False)
    keep = seq.prefix_cache.cached_prefix(prompt)
    t0 = time.perf_counter()
    seq.prefill(prompt, all_logits=False, keep=keep)
    return time.perf_counter() - t0


def llamacpp_turn(llm, prompt: list[int], cached: int) -> float:
    llm.reset()
    llm.eval(prompt[:cached])
    t0 = time.perf_counter()
    llm.eval(prompt[cached:])
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--cached", type=int, default=4000)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llama_cpp import Llama

    target = load_model(args.target)
    seq = make_backend("native", target)
    llm = Llama(model_path=str(target.gguf_path), n_ctx=args.cached + args.new + 16,
                n_threads=args.threads, verbose=False)
    rng = random.Random(0)
    prompt = [rng.randrange(100, min(target.vocab_size, 40000)) for _ in range(args.cached + args.new)]
    times: dict[str, list[float]] = {"specdec": [], "llamacpp": []}
    for r in range(args.rounds):
        times["specdec"].append(specdec_turn(seq, prompt, args.cached))
        times["llamacpp"].append(llamacpp_turn(llm, prompt, args.cached))
        print(f"round {r}: specdec {times['specdec'][-1]:.3f} s, llama.cpp {times['llamacpp'][-1]:.3f} s",
              flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(json.dumps({
        "columns": ["engine", "turn seconds (median)", "new tokens / s", "over llama.cpp"],
        "rows": [[name, round(median[name], 3), round(args.new / median[name], 1),
                  round(median["llamacpp"] / median[name], 2)] for name in ("specdec", "llamacpp")],
        "cached": args.cached, "new": args.new, "threads": args.threads, "rounds": args.rounds,
    }))


if __name__ == "__main__":
    main()
