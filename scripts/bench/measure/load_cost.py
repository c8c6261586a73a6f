"""Load time and memory of GGUF files on the native backend, each in fresh interpreters (see
docs/performance-notes.md, "A 1.5B-shaped model"):

    python scripts/bench/measure/load_cost.py FILE_OR_NAME... [--runs 3] [--threads 2] [--table files|stages]

Per file, `--runs` fresh processes (after one not counted, which fills the tokenizer cache)
each import the runtime (torch, specdec, transformers' tokenizer classes, the compiled numba
kernels: the baseline, no model), then time `load_model(FILE)` (the tokenizer) and
`make_backend("native", loaded)` (the weights at their own types and the default KV cache),
then prefill 37 tokens and decode one. `--table files` (default): per file the median load
seconds, and RSS above the baseline after loading (the tokenizer's share, and the weights'
with the KV cache) against 1.3 x (file + KV cache). `--table stages`: where the first file's
process memory goes, stage by stage (RSS and seconds, medians). Ends with a JSON line
(columns and rows: record.py's table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LIMIT = 1.3  # the bound: RSS above the baseline <= LIMIT x (file + KV cache)
PROMPT = list(range(3, 40))  # 37 token ids, valid in every vocabulary


def rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def child(target: str, threads: int) -> dict:
    """One fresh process: (name, RSS MB, seconds) per stage, the file's and the KV's MB."""
    stages, clock = [("python", rss_mb(), 0.0)], time.perf_counter()

    def stage(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        stages.append((name, rss_mb(), now - clock))
        clock = now

    import torch

    torch.set_num_threads(threads)
    stage("import torch")
    import specdec.backends.native  # noqa: F401 - registers the backend
    from specdec.backends import make_backend
    from specdec.models import load_model, resolve

    stage("import specdec")
    from transformers import AutoTokenizer  # noqa: F401 - what every tokenizer load imports

    stage("import transformers (tokenizers)")
    from specdec.backends.native.timing import load_kernels

    load_kernels()  # the runtime's compiled kernels: per process, not per model
    stage("compiled kernels (numba)")
    loaded = load_model(target)
    stage("tokenizer")
    seq = make_backend("native", loaded)
    stage("weights + KV cache (make_backend)")
    seq.prefill(PROMPT)
    stage("first prefill (37 tokens)")
    seq.forward([5])
    stage("one decode step")
    pool = seq.pool
    kv = sum(t.untyped_storage().nbytes() for t in (pool.k, pool.v))
    return {"stages": stages, "file_MB": os.path.getsize(resolve(target)[1]) / 1e6, "kv_MB": kv / 1e6,
            "kv_tokens": pool.max_length}


def measure(target: str, runs: int, threads: int) -> list[dict]:
    """`runs` fresh processes' stages, after one more not counted: a file's first load converts its
    tokenizer into the cache (seconds to a minute, once per file) and numba may compile."""
    out = []
    for i in range(runs + 1):
        run = subprocess.run([sys.executable, __file__, "--child", target, "--threads", str(threads)],
                             stdout=subprocess.PIPE, text=True, check=True)
        if i:
            out.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return out


def stage_value(results: list[dict], name: str, index: int) -> float:
    """The median over runs of one stage's RSS (index 1) or seconds (index 2)."""
    return statistics.median(next(s[index] for s in r["stages"] if s[0] == name) for r in results)


def file_row(target: str, results: list[dict]) -> list:
    baseline = stage_value(results, "compiled kernels (numba)", 1)
    tokenizer_mb = stage_value(results, "tokenizer", 1) - baseline
    loaded = stage_value(results, "weights + KV cache (make_backend)", 1) - baseline
    forward = stage_value(results, "one decode step", 1) - baseline
    tokenizer_s = stage_value(results, "tokenizer", 2)
    weights_s = stage_value(results, "weights + KV cache (make_backend)", 2)
    file_mb, kv_mb = results[0]["file_MB"], results[0]["kv_MB"]
    bound = LIMIT * (file_mb + kv_mb)
    return [os.path.basename(target), f"{file_mb:.1f}", f"{kv_mb:.1f} ({results[0]['kv_tokens']} tokens)",
            f"**{tokenizer_s + weights_s:.2f}** ({tokenizer_s:.2f} + {weights_s:.2f})",
            f"{tokenizer_mb:.1f}", f"{loaded - tokenizer_mb:.1f}", f"**{loaded:.1f}**", f"{forward:.1f}",
            f"{bound:.1f}", f"{loaded / (file_mb + kv_mb):.2f}x", "yes" if loaded <= bound else "**no**"]  # fmt: skip


def stage_rows(results: list[dict]) -> list[list]:
    rows, before = [], 0.0
    for name, _, _ in results[0]["stages"]:
        rss, seconds = stage_value(results, name, 1), stage_value(results, name, 2)
        rows.append([name, f"{rss:.1f}", f"{rss - before:+.1f}", f"{seconds:.2f}"])
        before = rss
    return rows


FILE_COLUMNS = ["File", "Size MB", "KV MB", "Load s (tokenizer + weights)", "RSS: tokenizer MB",
                "RSS: weights + KV MB", "RSS above baseline MB", "after a forward MB", f"{LIMIT} x (file + KV) MB",
                "RSS / (file + KV)", "Within"]  # fmt: skip
STAGE_COLUMNS = ["Stage", "RSS MB", "Change MB", "Seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="+", help="GGUF files or built-in names")
    p.add_argument("--runs", type=int, default=3, help="fresh processes per file (medians)")
    p.add_argument("--threads", type=int, default=2, help="torch (and numba) threads")
    p.add_argument("--table", choices=("files", "stages"), default="files")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.targets[0], args.threads)))
        return
    report: dict = {"runs": args.runs, "threads": args.threads, "limit": LIMIT, "measured": {}}
    rows = []
    for target in args.targets if args.table == "files" else args.targets[:1]:
        results = measure(target, args.runs, args.threads)
        report["measured"][target] = results
        row = file_row(target, results)
        rows.append(row)
        print("  ".join(f"{c}: {v}" for c, v in zip(FILE_COLUMNS, row, strict=True)), flush=True)
    if args.table == "stages":
        report["columns"], report["rows"] = STAGE_COLUMNS, stage_rows(results)
    else:
        report["columns"], report["rows"] = FILE_COLUMNS, rows
    print(json.dumps(report))


if __name__ == "__main__":
    main()
