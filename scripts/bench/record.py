"""Run a benchmark and record its result for the docs: docs/results/NAME.json, which
`make docs` renders as a table on the benchmarks page (docs/benchmarks.md shows it with
<!-- results: NAME -->).

    python scripts/bench/record.py NAME --title TITLE -- COMMAND...
    python scripts/bench/record.py llamacpp --title "Against llama.cpp" -- \\
        specdec bench --limit 4 --methods none,ngram,suffix --peers llamacpp --max-new-tokens 128 --out out/bench

A `specdec bench ... --out DIR` command is read from DIR/results.json and becomes one row per
method and peer (speedup per category, overall, tau, tok/s, exact match, valid calls); any
other command must end its stdout with one JSON object (every script under scripts/bench does),
recorded as it came and shown key by key, or as its own table where the object has `columns`
and `rows` (and with its own thread count where it has `threads`). The record keeps the CPU, torch's thread count, the
commit (with `+dirty` when the tree has changes), the date and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # other records written since the commit do not change what ran
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/results")
    return head + ("+dirty" if changed else "")


def bench_rows(results: dict) -> tuple[list[str], list[list]]:
    """`specdec bench` results.json -> columns and rows, one row per method and peer."""
    first = next(iter(results["methods"].values()))
    cats = list(first["per_category"])
    calls = first.get("valid_calls") is not None
    columns = ["Method", *cats, "Overall", "τ", "tok/s", "Exact match"] + (["Valid calls"] if calls else [])
    rows = []
    for kind in ("methods", "peers"):
        for name, entry in results.get(kind, {}).items():
            per = entry["per_category"]
            tau = entry.get("mean_accepted_length")
            row = [f"`{name}`" + (" (peer)" if kind == "peers" else ""),
                   *[_x(per.get(cat, {}).get("speedup")) for cat in cats], _x(entry["speedup"]),
                   None if tau is None or kind == "peers" else f"{tau:.2f}",
                   f"{entry['tokens_per_second']:.1f}", entry.get("exact_match")]
            rows.append(row + ([entry.get("valid_calls")] if calls else []))
    return columns, rows


def script_table(raw) -> tuple[dict, int | None]:
    """A script's JSON -> its own table ({"columns", "rows"}, or {} to show it key by key) and
    the thread count it says it ran with (None: not said)."""
    if not isinstance(raw, dict):
        return {}, None
    table = {key: raw[key] for key in ("columns", "rows")} if {"columns", "rows"} <= raw.keys() else {}
    threads = raw.get("threads")
    return table, threads if isinstance(threads, int) and not isinstance(threads, bool) else None


def _x(speedup) -> str | None:
    return None if speedup is None else f"{speedup:.2f}x"


def out_dir(command: list[str]) -> Path | None:
    for i, arg in enumerate(command):
        if arg == "--out" and i + 1 < len(command):
            return Path(command[i + 1])
        if arg.startswith("--out="):
            return Path(arg.split("=", 1)[1])
    return Path("out/bench") if command[:2] == ["specdec", "bench"] else None  # bench's default --out


def main() -> None:
    p = argparse.ArgumentParser(usage="%(prog)s NAME --title TITLE [--notes NOTES] -- COMMAND...",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("name", help="the results file's name: docs/results/NAME.json")
    p.add_argument("--title", required=True, help="the table's title on the benchmarks page")
    p.add_argument("--notes", default="", help="a sentence shown under the table")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        p.error("give the benchmark's command after --")
    run = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(run.stdout)
    record = {"title": args.title, "command": shlex.join(command),
              "rerun": shlex.join(["python", "scripts/bench/record.py", args.name, "--title", args.title, "--",
                                   *command]),
              "machine": {"cpu": cpu_name(), "threads": None}, "commit": commit(),
              "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), "notes": args.notes}
    out = out_dir(command)
    if out is not None and (out / "results.json").exists():
        results = json.loads((out / "results.json").read_text())
        record["machine"]["threads"] = results["machine"]["torch_threads"]
        record["columns"], record["rows"] = bench_rows(results)
    else:
        lines = [line for line in run.stdout.splitlines() if line.strip()]
        try:
            record["raw"] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise SystemExit(f"record: the command's last line of stdout is not JSON (exit status {run.returncode})") from None
        table, threads = script_table(record["raw"])
        record.update(table)
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        record["machine"]["threads"] = threads
    if run.returncode != 0:
        record["notes"] = (record["notes"] + f" The command exited with status {run.returncode}.").strip()
    path = ROOT / "docs" / "results" / f"{args.name}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"record: wrote {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
