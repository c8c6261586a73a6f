"""τ and decode speed of one drafter as chains and as token trees of fixed sizes, on the
first turn of the first `--limit` bench questions per category (agent sessions left out).

    python scripts/bench/measure/tree_sweep.py --drafter eagle:runs/smollm2-eagle-all [--limit 1]

Each setting is (k, nodes): chains at k = 2 and 3, trees of 3, 7, 12 and 16 nodes at depths
3-6. The engine gives a fixed-k tree only k nodes (what the k-token chain costs); this script
lifts that cap to `nodes`, to see how τ grows with a tree's size and what scoring it costs.
It prints one line per setting: τ, decode tok/s (prefill left out), and the milliseconds a
step spends drafting and scoring. Eager native backend, greedy, 128 new tokens.
"""

from __future__ import annotations

import argparse

from specdec import controller
from specdec.bench.run import load_questions
from specdec.engine import Engine
from specdec.models import load_model

SETTINGS = [(0, None), (2, None), (3, None), (3, 3), (3, 7), (4, 7), (5, 12), (6, 16)]  # (k, tree nodes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="eagle:runs/smollm2-eagle-all")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--limit", type=int, default=1)
    args = p.parse_args()
    budget: dict[str, int] = {}
    controller.FixedK.tree_nodes = lambda self, k: budget.get("nodes", k)
    target = load_model(args.target)
    questions = load_questions(limit=args.limit)
    prompts = [q.turns[0] for q in questions if q.category != "agent_sessions" and q.session is None]
    for k, nodes in SETTINGS:
        method = "none" if k == 0 else args.drafter + (":tree=1" if nodes else "")
        engine = Engine(target, method, k=k, backend="native")
        engine.generate("Warm up with a short answer.", max_new_tokens=16)
        budget.clear()
        if nodes:
            budget["nodes"] = nodes
        steps = emitted = tokens = 0
        decode_s = propose_s = score_s = 0.0
        for prompt in prompts:
            out = engine.generate(prompt, max_new_tokens=128)
            s = out.stats
            steps, emitted, tokens = steps + s.num_steps, emitted + s.num_emitted_tokens, tokens + len(out.token_ids)
            decode_s, propose_s, score_s = decode_s + s.wall_s - s.prefill_s, propose_s + s.propose_s, score_s + s.score_s
        print(f"{method:44s} k={k} nodes={nodes or '-':>2}: tau {emitted / steps:.2f}  decode {tokens / decode_s:5.1f} "
              f"tok/s  draft {1000 * propose_s / steps:5.1f} ms/step  score {1000 * score_s / steps:5.1f} ms/step",
              flush=True)


if __name__ == "__main__":
    main()
