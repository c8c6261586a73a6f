"""How fast agent sessions could get with a drafter that already knows the answers.

    python scripts/bench/measure/agent_ceiling.py [--methods none,suffix] [--k auto] [--prefix-cache prompt]

Runs the shipped agent sessions twice in one process, each pass the way `specdec bench`
runs them (every session's turns in order, each turn after the runner's own answers). The
first pass teaches `suffix`'s process-wide store every answer; the second pass is timed and
printed. The same sessions come back token for token (greedy), so the drafter can copy
nearly all of each answer: its speedup there is a ceiling for any drafter on this machine,
set by the prefill and by what scoring k tokens costs. Eager native backend, 128 new tokens.
"""

from __future__ import annotations

import argparse
import json

from specdec.bench.run import load_questions, make_engine_runners, run_benchmark, summarize
from specdec.config import EngineConfig
from specdec.models import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="none,suffix", help="the first is the baseline")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--k", default="auto", help="for the speculative methods: auto or a fixed k")
    p.add_argument("--prefix-cache", default="prompt", choices=["prompt", "decoded", "off"])
    args = p.parse_args()
    target = load_model(args.target)
    questions = load_questions(categories=["agent_sessions"])
    config = EngineConfig(backend="native", k=args.k, prefix_cache=args.prefix_cache)
    runners = make_engine_runners(target, args.methods.split(","), config)
    run_benchmark(target, questions, runners, max_new_tokens=128, progress=False)  # the teaching pass
    run = run_benchmark(target, questions, runners, max_new_tokens=128, progress=False)
    results = summarize(run)
    for name, entry in results["methods"].items():
        keep = ("speedup", "tokens_per_second", "decode_speedup", "prefill_share", "mean_accepted_length",
                "exact_match")
        print(json.dumps({"method": name, **{key: entry.get(key) for key in keep}}))


if __name__ == "__main__":
    main()
