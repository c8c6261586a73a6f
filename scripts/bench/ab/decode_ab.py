"""Decode speed of one source tree, for A/B runs of two trees on one machine.

    PYTHONPATH=OLD_TREE/src python scripts/bench/ab/decode_ab.py none,ngram
    PYTHONPATH=src python scripts/bench/ab/decode_ab.py none,ngram [--backend-option lm_head=int8]

Per drafter: the embedded model on the native backend, greedy, two prompts of 128 new
tokens, each run twice; prints the best decode-only rate (wall time minus prefill) per prompt
as one JSON line. Alternate the trees in turns and compare medians.
"""

from __future__ import annotations

import argparse
import json

from specdec.config import EngineConfig
from specdec.engine import Engine

PROMPTS = ["Write a short story about a robot learning to paint.",
           "Explain how a hash map works, with an example in Python."]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("drafters", help="comma-separated drafter specs, e.g. none,ngram")
    p.add_argument("--backend-option", action="append", default=[], help="KEY=VALUE for the native backend")
    args = p.parse_args()
    options = dict(o.split("=", 1) for o in args.backend_option)
    out = {}
    for drafter in args.drafters.split(","):
        config = EngineConfig(backend="native", drafter=drafter, **({"backend_options": options} if options else {}))
        engine = Engine(config=config)
        engine.generate(PROMPTS[0], max_new_tokens=16)  # warm-up
        best = []
        for prompt in PROMPTS:
            rates = []
            for _ in range(2):
                r = engine.generate(prompt, max_new_tokens=128)
                rates.append(len(r.token_ids) / (r.stats.wall_s - r.stats.prefill_s))
            best.append(round(max(rates), 1))
        out[drafter] = best
    print(json.dumps(out))


if __name__ == "__main__":
    main()
