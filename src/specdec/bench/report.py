"""Writing a benchmark run: results.json, questions.jsonl, results.md and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from specdec.bench.run import BenchRun, question_records, summarize


def machine_info() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def write_report(run: BenchRun, out_dir: str | Path, settings: dict, plots: bool = True) -> dict:
    """Write every output file under out_dir; return the results.json object."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = summarize(run)
    results["machine"] = machine_info()
    results["settings"] = settings
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    with open(out / "questions.jsonl", "w") as f:
        for row in question_records(run):
            f.write(json.dumps(row) + "\n")
    (out / "results.md").write_text(markdown(results))
    if plots:
        plot_all(run, results, out)
    return results


# ---- markdown -----------------------------------------------------------------------------


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _rows(results: dict):
    for kind in ("methods", "peers"):
        for name, entry in results[kind].items():
            yield name + (" (peer)" if kind == "peers" else ""), entry


def markdown(results: dict) -> str:
    """An overview table (speedup per category, Spec-Bench style) and one table per category."""
    cats = list(next(iter(results["methods"].values()))["per_category"])
    s = results.get("settings", {})
    lines = []
    if s.get("command"):
        lines += [f"Command: `{s['command']}`", ""]
    lines += [f"Baseline: `{results['baseline']}` (plain decoding on the same engine). "
              "Speedup = mean over questions of tok/s, divided by the baseline's. Per category, "
              "the decode-only speedup leaves each turn's prefill out of its wall time, and the "
              "prefill share is the part of the wall time spent reading prompts.", ""]
    calls = _has_calls(results)
    if calls:
        lines += [f"Tool sessions decoded {'with' if s.get('grammar', True) else 'without'} their grammars. "
                  "Valid calls: of the turns that must call, those whose calls all parse and validate "
                  "against their tool's schema; forced: the share of emitted tokens the grammar forced.", ""]
    head = ["Method", *cats, "Overall", "τ", "Accept", "tok/s", "Exact match",
            *(_CALL_HEAD if calls else [])]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, e in _rows(results):
        cells = [f"`{name}`", *(_fmt(e["per_category"][c]["speedup"], ".2f", "x") for c in cats)]
        cells += [
            f"**{_fmt(e['speedup'], '.2f', 'x')}**", _fmt(e["mean_accepted_length"]),
            _fmt(e["acceptance_rate"], ".0%") if e["acceptance_rate"] is not None else "–",
            _fmt(e["tokens_per_second"], ".1f"), e["exact_match"], *(_call_cells(e) if calls else []),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for cat in cats:
        cat_calls = _has_calls(results, cat)
        head = ["Method", "tok/s", "Speedup", "Decode-only speedup", "Prefill share", "τ", "Exact match",
                *(_CALL_HEAD if cat_calls else [])]
        lines += ["", f"### {cat}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, e in _rows(results):
            c = e["per_category"][cat]
            lines.append(
                f"| `{name}` | {_fmt(c['tokens_per_second'], '.1f')} | {_fmt(c['speedup'], '.2f', 'x')} | "
                f"{_fmt(c.get('decode_speedup'), '.2f', 'x')} | {_fmt(c.get('prefill_share'), '.0%')} | "
                f"{_fmt(c['mean_accepted_length'])} | {c['exact_match']} |"
                + ("".join(f" {cell} |" for cell in _call_cells(c)) if cat_calls else "")
            )
    if results.get("mismatches"):
        lines += ["", "### Mismatches against the baseline", ""]
        for m in results["mismatches"]:
            lines.append(
                f"- `{m['runner']}` ({m['kind']}) question {m['question_id']} turn {m['turn']}: "
                f"first difference at token {m['position']}"
                + ("" if m.get("same_weights", True) else " (other weights: expected)")
            )
    for note in results.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


_CALL_HEAD = ["Valid calls", "Forced"]


def _has_calls(results: dict, category: str | None = None) -> bool:
    """Whether the run had turns that must call (tool sessions), overall or in `category`."""
    entries = [e if category is None else e["per_category"][category] for _, e in _rows(results)]
    return any(e.get("valid_calls") is not None for e in entries)


def _call_cells(e: dict) -> list[str]:
    rate = e.get("valid_call_rate")
    valid = "–" if rate is None else f"{e['valid_calls']} ({rate:.0%})"
    return [valid, _fmt(e.get("forced_share"), ".0%")]


def summary_line(results: dict, out_dir: str | Path) -> str:
    """The one-line JSON summary that ends stdout."""
    def brief(e: dict) -> dict:
        keys = ("speedup", "tokens_per_second", "mean_accepted_length", "exact_match", "valid_calls")
        return {k: e[k] for k in keys if k in e and (k != "valid_calls" or e[k] is not None)}

    return json.dumps({
        "out": str(out_dir),
        "baseline": results["baseline"],
        "methods": {n: brief(e) for n, e in results["methods"].items()},
        "peers": {n: brief(e) for n, e in results["peers"].items()},
        "mismatches": len(results.get("mismatches", [])),
    })


# ---- plots --------------------------------------------------------------------------------


def plot_all(run: BenchRun, results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    return [plot_speedup(results, out / "speedup.png"),
            plot_accept_lengths(run, out / "accept_lengths.png"),
            plot_k_history(run, out / "k_history.png")]


def plot_speedup(results: dict, path: Path) -> Path:
    """Grouped bars: speedup per category (and overall) for every method and peer."""
    import matplotlib.pyplot as plt

    rows = [(n, e) for n, e in _rows(results) if n != results["baseline"]]
    cats = list(next(iter(results["methods"].values()))["per_category"])
    groups = [*cats, "overall"]
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(groups) + 2), 4.5))
    for i, (name, e) in enumerate(rows):
        ys = [e["per_category"][c]["speedup"] or 0.0 for c in cats] + [e["speedup"] or 0.0]
        xs = [g + (i - (len(rows) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    ax.set_ylabel(f"speedup over `{results['baseline']}`")
    ax.set_title("Speedup per category (mean tok/s ratio)")
    if rows:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_accept_lengths(run: BenchRun, path: Path) -> Path:
    """Share of decoding steps that emitted 1, 2, 3, ... tokens, per method."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    methods = [r.name for r in run.runners if r.kind == "method" and r.name != run.baseline]
    hists = {}
    for name in methods:
        lengths = [n for turns in run.records[name].values() for t in turns for n in t.accept_lengths]
        if lengths:
            hists[name] = [lengths.count(n) / len(lengths) for n in range(1, max(lengths) + 1)]
    width = 0.8 / max(1, len(hists))
    for i, (name, h) in enumerate(hists.items()):
        ax.bar([n + 1 + (i - (len(hists) - 1) / 2) * width for n in range(len(h))], h, width, label=name)
    ax.set_xlabel("tokens emitted per target forward (accepted + 1)")
    ax.set_ylabel("share of steps")
    ax.set_title("Accepted length distribution")
    if hists:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_k_history(run: BenchRun, path: Path) -> Path:
    """The k chosen at each decoding step across the whole run, in run order; one panel per method."""
    import matplotlib.pyplot as plt

    series = {}
    for r in run.runners:
        if r.kind == "method" and r.name != run.baseline:
            recs = run.records[r.name]
            series[r.name] = [k for qi in sorted(recs) for t in recs[qi] for k in t.k_history]
    fig, axes = plt.subplots(max(1, len(series)), 1, figsize=(10, 1.2 + 1.6 * max(1, len(series))),
                             sharex=True, squeeze=False)
    for ax, (name, ks) in zip(axes[:, 0], series.items(), strict=False):
        ax.plot(range(len(ks)), ks, linewidth=0.6, drawstyle="steps-post")
        ax.set_ylabel("k")
        ax.set_title(name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("decoding step (all questions, in run order)")
    fig.suptitle("Draft length k chosen over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_table(results: dict, file=sys.stdout) -> None:
    calls = _has_calls(results)
    for name, e in _rows(results):
        valid, forced = _call_cells(e)
        print(
            f"{name:<28} speedup {_fmt(e['speedup'], '.2f', 'x'):>7}  "
            f"{_fmt(e['tokens_per_second'], '.1f'):>7} tok/s  "
            f"decode-only {_fmt(e.get('decode_speedup'), '.2f', 'x'):>6}  "
            f"tau {_fmt(e['mean_accepted_length']):>5}  exact {e['exact_match']}"
            + (f"  valid calls {valid}  forced {forced}" if calls else ""),
            file=file,
        )
