"""Fuzz the closing guarantee (issue 27) at full size: random JSON schemas x token budgets.

Each case (specdec.bench.closing_fuzz) asks for a `json_schema` reply, a required tool call
(one, or parallel calls) or JSON mode, with a budget drawn around the closing length from the
start, from a stub model that never wants to stop. A budget below that length must be refused;
any other reply must fit it, finish "stop" / "tool_calls", validate against the schema, and be
token for token the same under speculative decoding (k=4) as under plain decoding.

Prints one line per failing case and a summary; the last line of stdout is one JSON object.
Exits 1 when any case fails.

    python scripts/bench/measure/fuzz_closing.py [--cases 500] [--seed 0] [--tokenizer smollm2-135m|tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load(name: str):
    """(tokenizer, EOS ids): a built-in model's tokenizer, or the test suite's tiny BPE."""
    if name == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import tiny_tokenizer  # the tiny byte-level BPE the tests train in-process

        tok = tiny_tokenizer()
    else:
        from specdec.models import load_tokenizer

        tok = load_tokenizer(name)
    return tok, {tok.eos_token_id}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=500, help="cases to draw (default 500)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--tokenizer", default="smollm2-135m",
                        help="a built-in model's tokenizer, or 'tiny' (the tests' 400-token BPE)")
    args = parser.parse_args()

    from hypothesis import HealthCheck, Phase, given, seed, settings

    from specdec.bench.closing_fuzz import cases, run_case

    tok, eos = load(args.tokenizer)
    prompt = tok.encode("Fill in the record.")
    outcomes = []

    @seed(args.seed)
    @settings(max_examples=args.cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def draw(case):
        outcome = run_case(case, tok, eos, prompt)
        outcomes.append(outcome)
        if len(outcomes) % 25 == 0:
            print(f"{len(outcomes)} cases, {sum(bool(o.problems) for o in outcomes)} failed", file=sys.stderr, flush=True)
        if outcome.problems:
            print(json.dumps({"case": vars(case), "problems": outcome.problems, "text": outcome.text[:300]}))

    start = time.perf_counter()
    draw()
    served = [o for o in outcomes if not o.refused]
    summary = {
        "tokenizer": args.tokenizer, "seed": args.seed, "cases": len(outcomes),
        "refused": len(outcomes) - len(served), "served": len(served),
        "valid_and_identical": sum(not o.problems for o in served),
        "failed": sum(bool(o.problems) for o in outcomes),
        "closed_by_budget": sum(o.closed_by_budget for o in served),
        "drafts_accepted": sum(o.accepted for o in served),
        "accepted_drafts_cut_by_budget": sum(o.replaced_drafts for o in served),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
