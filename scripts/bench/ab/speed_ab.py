"""Is one source tree as fast as another? Plain decoding against llama.cpp
(`decode_vs_llamacpp.py`) and the native forwards' costs (`forward_costs.py`) on GGUF files,
each tree's own copy of each script in a fresh process (`PYTHONPATH=TREE/src`), the trees
in turns, for several rounds.

    python scripts/bench/ab/speed_ab.py OLD_TREE NEW_TREE [--targets smollm2-135m,gemma3-270m]
        [--rounds 3] [--threads 2]

A tree's script is found at scripts/bench/measure/NAME or, in trees before that folder,
scripts/bench/NAME. Per target and figure: the median over rounds for each tree and NEW/OLD
(a time: below 1 is faster; a rate: above 1 is faster). llama.cpp's own rate is measured in
every decode run, so a drifting machine shows in it. Ends with one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def script(tree: Path, name: str) -> Path:
    for candidate in (tree / "scripts/bench/measure" / name, tree / "scripts/bench" / name):
        if candidate.exists():
            return candidate
    raise SystemExit(f"{tree}: no {name}")


def run_json(tree: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode:
        raise SystemExit(f"{tree}: {' '.join(args)}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_round(tree: Path, target: str, path: str, threads: int) -> dict[str, float]:
    decode = run_json(tree, [str(script(tree, "decode_vs_llamacpp.py")), "--target", target,
                             "--threads", str(threads), "--runs", "1"])
    costs = run_json(tree, [str(script(tree, "forward_costs.py")), path, "--threads", str(threads)])
    return {"decode_tok_s": decode["rates"]["specdec native"][0],
            "llamacpp_tok_s": decode["rates"]["llama.cpp"][0],
            "step_ms": costs["step_ms"], "tree6_ms": costs["tree6_ms"], "batch2_ms": costs["batch2_ms"],
            "prefill760_s": min(costs["prefill760_s"])}


RATES = ("decode_tok_s", "llamacpp_tok_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs=2, help="OLD_TREE NEW_TREE (folders holding src/)")
    parser.add_argument("--targets", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from specdec.models import resolve

    old, new = (Path(t).resolve() for t in args.trees)
    rows, raw = [], {}
    for target in args.targets.split(","):
        path = str(resolve(target)[1])
        samples: dict[Path, list[dict]] = {old: [], new: []}
        for r in range(args.rounds):
            for tree in ((old, new) if r % 2 == 0 else (new, old)):
                samples[tree].append(one_round(tree, target, path, args.threads))
                print(target, tree.name, samples[tree][-1], flush=True)
        raw[target] = {str(t): s for t, s in samples.items()}
        for figure in samples[old][0]:
            a = statistics.median(s[figure] for s in samples[old])
            b = statistics.median(s[figure] for s in samples[new])
            better = b / a if figure in RATES else a / b
            rows.append([target, figure, f"{a:.3f}", f"{b:.3f}", f"{b / a:.3f}", f"{better:.3f}"])
    print(json.dumps({"columns": ["Target", "Figure", "Old (median)", "New (median)", "New / old",
                                  "Speed, new over old"],
                      "rows": rows, "rounds": args.rounds, "threads": args.threads,
                      "trees": [str(old), str(new)], "samples": raw}))


if __name__ == "__main__":
    main()
