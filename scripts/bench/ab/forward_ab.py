"""Native forwards of two source trees in turns, in two live processes: what a kernel change
does to a chain, a token tree, a batch or a turn's prompt, on a machine too noisy for runs
made one after another.

    git worktree add /tmp/before HEAD~1
    python scripts/bench/ab/forward_ab.py /tmp/before . [--target smollm2-135m] [--context 100]
        [--cases chain:1,chain:8,chain:16,tree:6,batch:4,chain:256] [--rounds 30] [--kv-dtype fp32]

Each tree runs in a worker process of its own (`PYTHONPATH=TREE/src`, this script with
`--worker`) that loads the target on the native backend, prefills `--context` tokens into each
of 4 sequences and answers one block at a time: an untimed call (the first after a pause runs
slow), then every case once, each rolled back. The workers take blocks in turns, the order
flipping every round, with a pause between them so that one's idle threads stop spinning
before the other's block. Cases: chain:N (N tokens on one sequence), tree:6 (the 6-node tree
of scoring_cost.py), batch:N (4 sequences x N tokens). Only the public API is used
(`specdec.models.load_model`, `specdec.backends.make_backend`, the Backend protocol). Prints
each case's medians and minima and ends with one JSON line (columns and rows: record.py's table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = "chain:1,chain:8,chain:16,tree:6,batch:4"
TREE = [-1, 0, 0, 1, 1, 2]  # the root's two children, two below the first, one below the second
SEQUENCES = 4
PAUSE = 0.25  # seconds: a worker's thread pool spins for a while after its last call
TEXT = "The harbour office opened at seven, and the ferries waited for the fog. "


def worker(target_name: str, context: int, longest: int, kv_dtype: str | None) -> None:
    """Answer lines of cases (`chain:8 tree:6 ...`) with their seconds, one line each."""
    from specdec.backends import make_backend
    from specdec.models import load_model

    target = load_model(target_name)
    seq = make_backend("native", target, prefix_cache="off", slots=SEQUENCES,
                       max_length=context + longest + 8, kv_dtype=kv_dtype)
    seqs = [seq] + [seq.pool.new_sequence() for _ in range(SEQUENCES - 1)]
    ids = target.tokenizer.encode(TEXT * ((context + longest) // 8 + 16))
    for i, s in enumerate(seqs):
        s.prefill(ids[i : i + context], all_logits=False)
    new = ids[context : context + longest]

    def call(case: str) -> None:
        kind, n = case.split(":")
        if kind == "chain":
            seq.forward(new[: int(n)])
        elif kind == "tree":
            seq.forward_tree(new[: len(TREE)], TREE)
        elif kind == "batch":
            seq.pool.forward_batch(seqs, [new[: int(n)]] * SEQUENCES)
        else:
            raise SystemExit(f"forward_ab: unknown case {case!r}")
        for s in seqs if kind == "batch" else [seq]:
            s.rollback(context)

    print("ready", flush=True)
    for line in sys.stdin:
        cases = line.split()
        call(cases[0])  # untimed
        seconds = []
        for case in cases:
            start = time.perf_counter()
            call(case)
            seconds.append(time.perf_counter() - start)
        print(" ".join(map(str, seconds)), flush=True)


def start(tree: Path, args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve() / "src")}
    command = [sys.executable, __file__, "--worker", "--target", args.target, "--context", str(args.context),
               "--longest", str(longest(args.cases))]
    command += ["--kv-dtype", args.kv_dtype] if args.kv_dtype else []
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"forward_ab: the worker of {tree} did not start")
    return proc


def longest(cases: list[str]) -> int:
    return max(max(int(c.split(":")[1]), len(TREE)) for c in cases)


def measure(trees: list[Path], args) -> dict[tuple[str, str], list[float]]:
    workers = {str(tree): start(tree, args) for tree in trees}
    times = {(name, case): [] for name in workers for case in args.cases}
    for round_ in range(args.rounds):
        order = list(workers) if round_ % 2 == 0 else list(workers)[::-1]
        for name in order:
            time.sleep(PAUSE)
            proc = workers[name]
            proc.stdin.write(" ".join(args.cases) + "\n")
            proc.stdin.flush()
            for case, seconds in zip(args.cases, proc.stdout.readline().split(), strict=True):
                times[name, case].append(float(seconds))
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="*", type=Path, help="two or more source trees, the baseline first")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--cases", default=CASES, type=lambda s: s.split(","))
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--kv-dtype", choices=("bf16", "fp32"), help="the cache's type (default: the backend's)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--longest", type=int, default=16, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.target, args.context, args.longest, args.kv_dtype)
        return
    if len(args.trees) < 2:
        raise SystemExit("forward_ab: give two or more source trees")
    times = measure(args.trees, args)
    names = [str(tree) for tree in args.trees]
    rows = []
    for case in args.cases:
        medians = [statistics.median(times[name, case]) * 1e3 for name in names]
        minima = [min(times[name, case]) * 1e3 for name in names]
        ratios = [m / medians[0] for m in medians]
        rows.append([case, *(f"{m:.2f} (min {n:.2f}, {r:.2f}x)" for m, n, r in zip(medians, minima, ratios,
                                                                                 strict=True))])
        print(case, "  ".join(rows[-1][1:]), flush=True)
    columns = ["Case", *(f"{name} ms, median (min, x first)" for name in names)]
    print(json.dumps({"target": args.target, "context": args.context, "rounds": args.rounds,
                      "kv_dtype": args.kv_dtype, "columns": columns, "rows": rows}))


if __name__ == "__main__":
    main()
