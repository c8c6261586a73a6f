"""Multi-turn agent sessions against llama.cpp: the bench's agent data, every runner
interleaved question by question, repeated, medians per runner and prefix-cache mode.

    python scripts/bench/measure/agent_vs_llamacpp.py [--runs 3] [--limit 8] [--modes prompt,decoded]
        [--max-new-tokens 128] [--out out/agent-vs-llamacpp]

Each run is one `specdec bench --categories agent_sessions --methods none,ngram,suffix --peers
llamacpp` (the peer keeps its KV cache's longest common prefix across turns and questions, as
llama-server's prompt cache does). specdec's `--prefix-cache prompt` (the default) re-reads each
previous answer and up to 127 tokens of the 128-token reuse grid; `decoded` keeps the answers
too, as llama.cpp does. Ends with a JSON line (record.py's table): per mode and runner the
median tok/s, its ratio to llama.cpp's, the median prefill share, and the runs' tok/s.
Needs the `llamacpp` extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

RUNNERS = ("none", "ngram", "suffix")
PEER = "llamacpp"


def run_once(mode: str, limit: int, max_new_tokens: int, out: Path) -> dict:
    """One bench run -> {runner: (tok/s, prefill share or None)}."""
    command = [sys.executable, "-c", "from specdec.cli import main; main()", "bench",  # the `specdec` command
               "--categories", "agent_sessions", "--limit", str(limit), "--methods", ",".join(RUNNERS),
               "--peers", PEER, "--max-new-tokens", str(max_new_tokens), "--prefix-cache", mode, "--no-plots",
               "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    results = json.loads((out / "results.json").read_text())
    rows = {**results["methods"], **results["peers"]}
    return {name: (rows[name]["tokens_per_second"], rows[name]["prefill_share"]) for name in (*RUNNERS, PEER)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--limit", type=int, default=8, help="sessions (the shipped set has 8)")
    parser.add_argument("--modes", default="prompt,decoded", help="specdec --prefix-cache modes, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("out/agent-vs-llamacpp"))
    args = parser.parse_args()
    rows, measured = [], {}
    for mode in args.modes.split(","):
        runs = []
        for i in range(args.runs):
            runs.append(run_once(mode, args.limit, args.max_new_tokens, args.out / f"{mode}-{i}"))
            print(f"{mode} run {i + 1}: " + ", ".join(f"{n} {v[0]:.1f}" for n, v in runs[-1].items()), flush=True)
        measured[mode] = runs
        peer = statistics.median(r[PEER][0] for r in runs)
        for name in (*RUNNERS, PEER):
            tps = statistics.median(r[name][0] for r in runs)
            shares = [r[name][1] for r in runs if r[name][1] is not None]
            rows.append([mode, name if name != PEER else f"{PEER} (peer)", round(tps, 1), round(tps / peer, 2),
                         round(statistics.median(shares), 3) if shares else "–",
                         " / ".join(f"{r[name][0]:.1f}" for r in runs)])  # fmt: skip
    print(json.dumps({"columns": ["prefix cache", "runner", "tok/s (median)", "vs llama.cpp", "prefill share",
                                  "runs (tok/s)"], "rows": rows, "runs": args.runs, "limit": args.limit,
                      "measured": measured}))  # fmt: skip


if __name__ == "__main__":
    main()
