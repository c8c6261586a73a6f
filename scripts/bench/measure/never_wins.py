"""What a drafter that never wins costs: each request from a cold adaptive controller, against
plain decoding on the same prompt, in turns.

    python scripts/bench/measure/never_wins.py [--methods random,layerskip,model:PATH]
        [--data scripts/bench/data/fresh_prompts.jsonl] [--max-new-tokens 128] [--rounds 2] [--backend auto]

One engine per method (plain decoding is `none`) shares the loaded target. Before each request
the engine forgets what it learned (its cost model and the drafter's acceptance rate), so every
request starts cold: it calibrates the target's scoring costs again (outside the request's
time) and begins from the prior. The methods run one after another on each prompt, rotating
which goes first; each prompt's time is the median of `--rounds`. The prompts are
`fresh_prompts.jsonl` by default: poems, letters, recipes, stories, none like the shipped bench
set. Per method: the median and lowest per-request speedup over plain, the aggregate (total
plain time over total method time), τ, and whether every reply equals plain's (greedy).
Ends with one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_cold(engine, prompt: str, max_new_tokens: int):
    from specdec.controller import ScoreCosts

    engine.costs, engine.alpha_prior = ScoreCosts(), None  # a cold controller
    return engine.generate(prompt, max_new_tokens=max_new_tokens)


def measure(args) -> dict:
    from specdec import Engine
    from specdec.models import load_model

    prompts = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    target = load_model(args.target)
    methods = ["none", *[m for m in args.methods.split(",") if m and m != "none"]]
    engines = {m: Engine(target=target, drafter=m, k="auto", backend=args.backend) for m in methods}
    walls = {m: {p["id"]: [] for p in prompts} for m in methods}
    replies = {m: {} for m in methods}
    tau = {m: [0, 0] for m in methods}  # emitted tokens, steps
    for r in range(args.rounds):
        for i, p in enumerate(prompts):
            shift = (i + r) % len(methods)
            for m in methods[shift:] + methods[:shift]:
                result = run_cold(engines[m], p["prompt"], args.max_new_tokens)
                walls[m][p["id"]].append(result.stats.wall_s)
                replies[m][p["id"]] = result.token_ids
                tau[m][0] += result.stats.num_emitted_tokens
                tau[m][1] += result.stats.num_steps
    plain = {pid: statistics.median(ts) for pid, ts in walls["none"].items()}
    rows = []
    for m in methods[1:]:
        own = {pid: statistics.median(ts) for pid, ts in walls[m].items()}
        ratios = [plain[pid] / own[pid] for pid in own]
        aggregate = sum(plain.values()) / sum(own.values())
        rows.append([f"`{m}`", f"{statistics.median(ratios):.3f}x", f"{min(ratios):.3f}x",
                     f"{aggregate:.3f}x", f"{tau[m][0] / max(1, tau[m][1]):.2f}",
                     all(replies[m][pid] == replies["none"][pid] for pid in own)])
    return {"columns": ["Method", "median per request", "lowest", "aggregate", "τ", "replies equal plain"],
            "rows": rows, "prompts": len(prompts), "rounds": args.rounds,
            "max_new_tokens": args.max_new_tokens,
            "plain_tok_s": round(tau["none"][0] / sum(sum(ts) for ts in walls["none"].values()), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--methods", default="random,layerskip")
    parser.add_argument("--backend", default="auto", help="the target's backend, as the CLI's --backend")
    parser.add_argument("--data", default=str(ROOT / "scripts/bench/data/fresh_prompts.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    out = measure(args)
    for row in out["rows"]:
        print(*row, sep="  ")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
