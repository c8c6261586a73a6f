"""Long agent sessions walked by one engine in this process, turn after turn, each reply
appended before the next turn (as `specdec.bench.load --workload long-agent` does through a
server): the seconds spent prefilling, the prompt tokens the prefix cache kept, the tokens
generated and τ, per prefix-cache mode.

    python scripts/bench/measure/long_session_turns.py [--sessions 3] [--turns 3]
        [--drafter none] [--modes prompt,decoded] [--max-tokens 128] [--threads 2]

Greedy, on the embedded SmolLM2 (native backend). The sessions are `bench/long_sessions.py`'s
generated support-agent conversations of 4-6k tokens, not the shipped question set. Ends with a
JSON line for record.py.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec import Engine
from specdec.bench.long_sessions import make_long_sessions
from specdec.models import load_model
from specdec.tools import render_chat


def walk(engine: Engine, tokenizer, sessions, max_tokens: int) -> dict:
    """Every session's turns in order: totals over all the requests."""
    totals = {"requests": 0, "prefill_s": 0.0, "prompt_tokens": 0, "cached_tokens": 0, "generated": 0,
              "emitted": 0, "steps": 0}
    start = time.perf_counter()
    for session in sessions:
        messages = list(session.opening)
        for turn in session.turns:
            messages += turn
            result = engine.generate(render_chat(tokenizer, messages), max_new_tokens=max_tokens, chat=False)
            stats = result.stats
            totals["requests"] += 1
            totals["prefill_s"] += stats.prefill_s
            totals["prompt_tokens"] += stats.prompt_tokens
            totals["cached_tokens"] += stats.cached_prompt_tokens
            totals["generated"] += len(result.token_ids)
            totals["emitted"] += stats.num_emitted_tokens
            totals["steps"] += stats.num_steps
            messages.append({"role": "assistant", "content": result.text})
    totals["wall_s"] = time.perf_counter() - start
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--modes", default="prompt,decoded", help="prefix-cache modes, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model("smollm2-135m")
    tokenizer = target.tokenizer
    sessions = make_long_sessions(args.sessions, args.turns,
                                  lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
                                  reply_tokens=args.max_tokens, window=target.max_length)
    rows = []
    for mode in args.modes.split(","):
        engine = Engine(target=target, drafter=args.drafter, backend="native", prefix_cache=mode)
        t = walk(engine, tokenizer, sessions, args.max_tokens)
        tau = t["emitted"] / max(1, t["steps"])  # the stats' mean accepted length, bonus included
        prefilled = t["prompt_tokens"] - t["cached_tokens"]
        rows.append([mode, args.drafter, t["requests"], round(t["wall_s"], 2), round(t["prefill_s"], 2),
                     prefilled, t["cached_tokens"], t["generated"], round(tau, 2)])
        print(f"{mode:8s} {args.drafter}: wall {t['wall_s']:.1f} s, prefill {t['prefill_s']:.1f} s, "
              f"prefilled {prefilled} tokens, cached {t['cached_tokens']}, generated {t['generated']}, "
              f"tau {tau:.2f}", flush=True)
    columns = ["prefix cache", "drafter", "requests", "wall s", "prefill s", "prefilled tokens",
               "cached tokens", "generated", "tau"]
    print(json.dumps({"columns": columns, "rows": rows}))


if __name__ == "__main__":
    main()
