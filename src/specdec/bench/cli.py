"""`specdec bench`: the command line over bench.py, bench_peers.py and bench_report.py.

Exit status: 0, 2 for bad input, 1 when a method's greedy output differs from the
baseline's (a losslessness failure; results are still written). Peers never fail the run.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from specdec.bench.peers import make_peers, parse_peers
from specdec.bench.report import print_table, summary_line, write_report
from specdec.bench.run import load_questions, make_engine_runners, parse_methods, run_benchmark
from specdec.cli_args import add_engine_args, engine_config, nonneg_int, positive_int
from specdec.errors import SpecdecError
from specdec.models import load_model

# short enough for a full run of the shipped set on a CPU (docs/performance-notes.md)
DEFAULT_MAX_NEW_TOKENS = 64


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark methods and peers, Spec-Bench style")
    p.add_argument("--data", default=None, help="Spec-Bench question JSONL (default: the shipped set)")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--limit", type=positive_int, default=None, help="at most N questions per category")
    p.add_argument("--methods", help="comma-separated drafters, e.g. none,ngram,ngram:k=8,model:PATH "
                                     "(default: the --config file's drafter)")
    p.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (and checks exact matches)")
    add_engine_args(p)  # k applies to the methods without a `k=` of their own
    p.add_argument("--peers", default=None,
                   help="hf,hf-pld,hf-assisted,llamacpp or none (default: all that apply)")
    p.add_argument("--out", default="out/bench", help="output directory")
    p.add_argument("--warmup", type=nonneg_int, default=1, help="warm-up generations per runner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-grammar", action="store_true",
                   help="decode tool sessions without their grammars (tool_choice auto, unconstrained) and "
                        "parse what the model writes: the valid-call rate without structured output")
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> None:
    # Everything that can be checked without the model is checked first.
    if args.temperature < 0:
        raise SpecdecError(f"--temperature must be >= 0, got {args.temperature}", "temperature")
    config = engine_config(args)
    methods = parse_methods(args.methods or config.drafter, config.target)
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    if categories is not None and not all(categories):
        raise SpecdecError(f"--categories has an empty entry: {args.categories!r}", "categories")
    questions = load_questions(args.data, categories, args.limit)
    peers, notes = parse_peers(args.peers, methods, config.target)
    for note in notes:
        print(f"specdec bench: {note}", file=sys.stderr)

    target = load_model(config.target)
    runners = make_engine_runners(target, methods, config)
    engines = {r.name: r.engine for r in runners}
    compile_s = max(e.backend.compile_seconds for e in engines.values())
    if compile_s:
        print(f"specdec bench: compiled the native decode step in {compile_s:.1f}s", file=sys.stderr)
    runners += make_peers(peers, target, config.target, methods, engines)
    print(
        f"specdec bench: {len(questions)} questions, {sum(len(q.turns) for q in questions)} turns, "
        f"runners: {', '.join(r.name for r in runners)}",
        file=sys.stderr,
    )
    run = run_benchmark(
        target, questions, runners, args.max_new_tokens, args.temperature, args.warmup, args.seed,
        grammar=not args.no_grammar,
    )
    run.notes += notes
    if any(q.session for q in questions) and any(r.kind == "peer" for r in runners) and not args.no_grammar:
        run.notes.append("peers cannot constrain their output: they decode tool sessions without the grammar")
    settings = {
        "command": "specdec " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None,
        "data": str(args.data or "shipped:bench.jsonl"),
        "categories": categories,
        "limit_per_category": args.limit,
        "methods": methods,
        "peers": [r.name for r in runners if r.kind == "peer"],
        "target": config.target,
        "k": config.k,
        "backend": config.backend,
        "backend_options": config.backend_options,
        "compile_seconds": round(compile_s, 1) if compile_s else None,
        "draft_device": config.draft_device,
        "prefix_cache": config.prefix_cache,
        "verify_strategy": config.verify_strategy,
        "grammar": not args.no_grammar,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "warmup": args.warmup,
        "seed": args.seed,
        "questions": len(questions),
        "turns": sum(len(q.turns) for q in questions),
    }
    finish(run, args.out, settings, plots=not args.no_plots)


def finish(run, out_dir, settings: dict, plots: bool = True) -> dict:
    """Write the report, print the table and the JSON summary line; exit 1 on a method mismatch."""
    results = write_report(run, out_dir, settings, plots=plots)
    print_table(results)
    method_mismatches = [m for m in results["mismatches"] if m["kind"] == "method"]
    if method_mismatches:
        print(f"specdec bench: LOSSLESSNESS FAILURE: {len(method_mismatches)} method turn(s) differ from "
              f"the baseline; see {out_dir}/results.json", file=sys.stderr)
    print(summary_line(results, out_dir))
    sys.stdout.flush()
    if method_mismatches:
        sys.exit(1)
    return results
