"""The shipped set on several source trees in turns, for "no behaviour change" checks: each
round runs `specdec bench` once per tree (`PYTHONPATH=TREE/src`), the trees in the order given,
so drifts of a shared machine fall on all of them. Prints the medians of tok/s per tree and
method, their ratio to the first tree, and the exact-match counts; ends with one JSON line
(columns and rows) for record.py.

    git worktree add /tmp/before COMMIT~1 && git worktree add /tmp/after COMMIT
    python scripts/bench/ab/tree_ab.py /tmp/before /tmp/after --rounds 3 --out /tmp/ab
    python scripts/bench/ab/tree_ab.py /tmp/before /tmp/after --summarize --out /tmp/ab  # runs already made

Each run: `specdec bench --limit 2 --methods none,ngram,suffix --peers none --max-new-tokens 128`;
--methods replaces the drafters, e.g. `none,ngram:k=4,suffix:k=4`: a fixed k takes the
adaptive k's reading of measured costs out of an A/B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

METHODS = "none,ngram,suffix"
BENCH = ["bench", "--limit", "2", "--peers", "none", "--max-new-tokens", "128", "--no-plots"]


def run(tree: Path, out: Path, methods: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    command = [sys.executable, "-m", "specdec.cli", *BENCH, "--methods", methods, "--out", str(out)]
    subprocess.run(command, cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def table(trees: list[Path], out: Path) -> dict:
    rates: dict[tuple[str, str], list[float]] = {}
    exact: dict[tuple[str, str], set[str]] = {}
    for tree in trees:
        for results in sorted(out.glob(f"{tree.name}_*/results.json")):
            for method, entry in json.loads(results.read_text())["methods"].items():
                rates.setdefault((tree.name, method), []).append(entry["tokens_per_second"])
                exact.setdefault((tree.name, method), set()).add(entry["exact_match"])
    methods = sorted({m for _, m in rates}, key=lambda m: (m.split(":")[0] != "none", m))
    columns = ["Tree", "Runs", *[f"`{m}` tok/s (median)" for m in methods], *[f"`{m}` vs first" for m in methods],
               "Exact match"]  # fmt: skip
    rows = []
    first = trees[0].name
    for tree in trees:
        medians = [statistics.median(rates[(tree.name, m)]) for m in methods]
        ratios = [statistics.median(rates[(tree.name, m)]) / statistics.median(rates[(first, m)]) for m in methods]
        runs = len(rates[(tree.name, methods[0])])
        spreads = [f"{x:.1f} ({min(rates[(tree.name, m)]):.1f}-{max(rates[(tree.name, m)]):.1f})"
                   for x, m in zip(medians, methods, strict=True)]  # fmt: skip
        rows.append([tree.name, runs, *spreads, *[f"{r:.3f}" for r in ratios],
                     ", ".join(sorted(set().union(*(exact[(tree.name, m)] for m in methods)))) ])  # fmt: skip
    return {"columns": columns, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    p.add_argument("trees", nargs="+", type=Path, help="source trees (git worktrees); the first is the baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("out/tree-ab"), help="one bench output folder per run: TREE_ROUND")
    p.add_argument("--summarize", action="store_true", help="only read the runs already under --out")
    p.add_argument("--methods", default=METHODS, help=f"the bench's drafters (default {METHODS})")
    args = p.parse_args()
    if not args.summarize:
        for r in range(1, args.rounds + 1):
            for tree in args.trees:
                run(tree.resolve(), args.out / f"{tree.name}_{r}", args.methods)
                print(f"round {r}: {tree.name} done", file=sys.stderr)
    print(json.dumps(table(args.trees, args.out)))


if __name__ == "__main__":
    main()
