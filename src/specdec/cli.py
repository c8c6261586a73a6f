"""`specdec` command line. Every user error is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

from specdec.bench import cli as bench_cli
from specdec.cli_args import add_engine_args, engine_config, positive_int
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.grammar import request_constraint
from specdec.request import Request
from specdec.serve import cli as serve_cli
from specdec.tools import CHOICES, tool_plan
from specdec.traffic_log import TrafficLog
from specdec.train import cli as train_cli
from specdec.train import datastore_cli

WARMUP_PROMPT = "Say hello."  # --compare-plain warms both engines on it, not on the timed prompt


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="a user chat message (plain text with --raw)")
    source.add_argument("--messages", metavar="FILE",
                        help="a JSON list of chat messages, OpenAI's form "
                             "(assistant tool_calls, role tool results)")
    add_engine_args(p, drafter="none | ngram[:min=N][:max=N] | suffix[:tree=1] | retrieval:DIR | "
                               "model:PATH_OR_NAME | layerskip[:FILE] | eagle:DIR (default ngram)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", nargs="+", default=None, help="stop strings")
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text, not a chat message")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--compare-plain", action="store_true",
                   help="also decode without speculation and report the speedup")
    p.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    p.add_argument("--log-dir",
                   help="append the prompt and output to a traffic log here (for distill --from-logs)")
    p.add_argument("--json-schema", metavar="FILE", help="constrain the reply to this JSON schema (strict)")
    p.add_argument("--tools", metavar="FILE",
                   help="a JSON file with an OpenAI `tools` list; the calls print as JSON")
    p.add_argument("--tool-choice", metavar="auto|required|none|NAME",
                   help="auto (default): the model may call; required: at least one call; "
                        "NAME: call that tool")
    p.add_argument("--no-parallel-tool-calls", action="store_true", help="at most one call in the reply")
    p.set_defaults(func=run_generate)


def read_json_file(path: str, flag: str):
    """A JSON file's value; a missing or malformed file is one SpecdecError line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"{flag} {path}: {getattr(e, 'strerror', None) or e}", flag.lstrip("-")) from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise SpecdecError(f"{flag} {path}: not JSON ({e})", flag.lstrip("-")) from None


def generate_request(args: argparse.Namespace) -> Request:
    """`generate`'s flags as one request value, read and checked before any model is loaded;
    a bad --json-schema or --tools file is named in the error."""
    prompt = args.prompt
    if args.messages:
        if args.raw:
            raise SpecdecError("--raw applies to --prompt, not --messages", "raw")
        prompt = read_json_file(args.messages, "--messages")
        prompt = prompt.get("messages") if isinstance(prompt, dict) else prompt
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise SpecdecError(f"--messages {args.messages}: expected a non-empty list of chat messages",
                               "messages")
    constraint = plan = None
    if args.json_schema:
        with _blame("--json-schema", args.json_schema):
            constraint = request_constraint(schema=read_json_file(args.json_schema, "--json-schema"))
    if not args.tools and (args.tool_choice is not None or args.no_parallel_tool_calls):
        raise SpecdecError("--tool-choice and --no-parallel-tool-calls need --tools", "tool_choice")
    if args.tools:
        tools = read_json_file(args.tools, "--tools")
        choice = args.tool_choice
        with _blame("--tools", args.tools):
            plan = tool_plan(tools.get("tools") if isinstance(tools, dict) else tools,
                             choice if choice in (None, *CHOICES)
                             else {"type": "function", "function": {"name": choice}},
                             False if args.no_parallel_tool_calls else None)
            if plan is not None:
                plan.constraint(constraint)  # a forced tool choice cannot take a schema too
    base = Request.build(prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.stop,
                         args.seed, chat=not args.raw)
    return dataclasses.replace(base, tools=plan, response_format=constraint)


@contextlib.contextmanager
def _blame(flag: str, path: str):
    """Prefix a SpecdecError with the flag and file it came from."""
    try:
        yield
    except SpecdecError as e:
        raise SpecdecError(f"{flag} {path}: {e.message}", e.param) from None


def run_generate(args: argparse.Namespace) -> None:
    request = generate_request(args)  # fail before loading
    config = engine_config(args)
    log = TrafficLog(args.log_dir) if args.log_dir else None
    engine = Engine(config=config)
    if engine.backend.compile_seconds:
        print(f"[native] compiled the decode step in {engine.backend.compile_seconds:.1f}s", file=sys.stderr)
    plain = plain_run(engine, config, request) if args.compare_plain else None
    streamed = args.stream and not args.json
    if streamed:
        stream = engine.stream(request)
        for delta in stream:
            print(delta, end="", flush=True)
        print()
        result = stream.result
    else:
        result = engine.generate(request)
    if not args.json:
        _print_reply(result, streamed)
    if log is not None:
        prompt = request.prompt
        logged = [{"role": "user", "content": prompt}] if isinstance(prompt, str) and not args.raw else prompt
        meta = {"target": engine.target.name, "chat": not args.raw, "finish_reason": result.finish_reason,
                "temperature": args.temperature, "drafter": engine.drafter_name}
        log.record(logged, result.text, meta)
    _print_result(args, engine, result, plain)


def plain_run(engine: Engine, config: EngineConfig, request: Request):
    """The same request decoded plainly: drafter none, k = 0, and a grammar's forced tokens
    scored one per forward too (a plain engine with k = 0 would still score them ahead).
    Both engines first warm up on another prompt, so that neither times one-time costs and
    neither finds the timed prompt in its cache."""
    baseline = Engine(engine.target, "none", config=config, k=0, draft_forced=False)
    # the warm-up is free text: a structure would not fit its 8 tokens (and is warmed by its first step)
    warmup = dataclasses.replace(request, prompt=WARMUP_PROMPT, max_tokens=8, tools=None,
                                 response_format=None)
    for warm in (baseline, engine):
        warm.generate(warmup)
    return baseline.generate(request)


def _print_reply(result, streamed: bool) -> None:
    """The reply's text; with tool calls, its content and then one JSON line per call."""
    if not result.tool_calls:
        if not streamed:
            print(result.text)
        return
    if result.content and not streamed:
        print(result.content)
    for call in result.tool_calls:
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError:
            arguments = fn["arguments"]  # a call cut short by max_new_tokens
        print(json.dumps({"name": fn["name"], "arguments": arguments}, ensure_ascii=False))


def _print_result(args: argparse.Namespace, engine: Engine, result, plain) -> None:
    summary = result.stats.summary()
    if plain is not None:
        summary["plain_tokens_per_second"] = plain.stats.summary()["tokens_per_second"]
        plain_tps = plain.stats.tokens_per_second
        summary["speedup_vs_plain"] = (round(result.stats.tokens_per_second / plain_tps, 3)
                                       if plain_tps else None)
        summary["matches_plain"] = plain.token_ids == result.token_ids
        # speculation cannot shorten the prompt's prefill, which both runs pay: the speedup without it
        decode, plain_decode = (r.stats.wall_s - r.stats.prefill_s for r in (result, plain))
        summary["decode_speedup_vs_plain"] = round(plain_decode / decode, 3) if decode > 0 else None
    if args.json:
        print(json.dumps({**result.to_dict(), "stats": summary, "drafter": engine.drafter_name}))
        return
    s = summary
    print(
        f"\n[{engine.drafter_name}, k={engine.k}] {s['generated_tokens']} tokens in {s['wall_time_s']:.2f}s "
        f"= {s['tokens_per_second']:.1f} tok/s | steps {s['steps']}, tau {s['mean_accepted_length']:.2f}, "
        f"drafted {s['drafted_tokens']}, accepted {s['accepted_tokens']} "
        f"({100 * s['acceptance_rate']:.0f}%), forced {s['forced_tokens']}, finish {result.finish_reason}",
        file=sys.stderr if args.stream else sys.stdout,
    )
    if plain is not None:
        print(
            f"[plain decoding, one token per forward] {s['plain_tokens_per_second']:.1f} tok/s "
            f"-> speedup {s['speedup_vs_plain']:.2f}x (decoding alone {s['decode_speedup_vs_plain']:.2f}x, "
            f"after a {s['prompt_tokens']}-token prefill of {1000 * s['prefill_s']:.0f} ms), "
            f"identical output: {s['matches_plain']}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_generate_parser(sub)
    for command in (bench_cli, serve_cli, datastore_cli, train_cli):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SpecdecError as e:
        print(f"specdec: error: {e.message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
        print(f"specdec: error: {e.strerror}: {e.filename}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
