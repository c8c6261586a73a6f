"""Concurrency benchmark for `specdec serve`: agent-like sessions against a live server.

Each session is a short multi-turn agent conversation (tool-call JSON, code edits, tables,
summaries); every turn resends the conversation so far and streams the reply. `c` sessions
run at once. For every (speculation on/off, concurrency) pair the same sessions are replayed,
each time with turns the server has not seen (see below), and we report aggregate completion
tokens/s, request latency p50/p99, time to first token p50/p99 and TPOT, plus acceptance from
the responses' `spec_decode`. The last line of stdout is one JSON object.

    python -m specdec.bench.load --target smollm2-135m --concurrency 1,4,8,16
    python -m specdec.bench.load --url http://127.0.0.1:8000 --sessions 16

Speculation off means the request body carries `"drafter": "none"`; on uses the server's
default drafter (or --drafter-on). "serial vs 8" is the ratio of aggregate tokens/s at
concurrency 8 to concurrency 1 with speculation on.

Long agent sessions and peers:

    python -m specdec.bench.load --workload long-agent --raw-prompt --peer llama-server \
        --modes off,on --concurrency 1,2,4 --rounds 3 --plot load.png

`--workload long-agent` replays support-agent conversations of 4-6k tokens (long_sessions.py).
`--raw-prompt` renders each conversation to text once, with specdec's chat template code, and
sends it to /v1/completions, so that every engine gets the same prompt text (later turns still
carry each engine's own replies). `--peer llama-server` adds llama.cpp's server, plain and with
`--spec-type ngram-mod` (llama_server.py); it only gets standard OpenAI fields and, with
`--ignore-eos`, `ignore_eos` (every reply runs to `--max-tokens` on both engines). `--rounds N`
runs every (engine, mode, concurrency) N times, the engines in turns within a round, and
reports medians (load_rounds.py); errors and lost replies are counted, never dropped. Each mode
of each engine is its own server process (with `--url`, one server takes both), and every
configuration's turns are new to it (load_rounds.fresh_turns), so no configuration finds the
prompts of an earlier one in a prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from specdec.bench import llama_server, server_time
from specdec.bench.load_rounds import (
    Target,
    first_turn_agreement,
    fresh_turns,
    mark_exact_matches,
    plot,
    schedule,
    summarize,
    variant,
)
from specdec.bench.long_sessions import Session, make_long_sessions
from specdec.models import load_model
from specdec.tools import render_chat

TOOLS = (
    '[{"name": "search", "parameters": {"query": "string"}}, '
    '{"name": "get_weather", "parameters": {"city": "string", "unit": "celsius|fahrenheit"}}, '
    '{"name": "run_python", "parameters": {"code": "string"}}]'
)
SYSTEM = (
    "You are an agent. Call tools by answering with one JSON object "
    '{"name": ..., "arguments": {...}} and nothing else. Available tools: ' + TOOLS
)
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Nairobi", "Austin", "Hanoi", "Perth"]
CODE = (
    "def total_price(items, tax):\n    total = 0\n    for item in items:\n"
    "        total = total + item['price'] * item['quantity']\n    return total * (1 + tax)\n"
)
CSV = "name,role,team\nAda,engineer,core\nLin,designer,web\nSam,manager,core\nKai,engineer,web\n"
DOC = (
    "Speculative decoding lets a small draft propose several tokens that the large model "
    "verifies in one forward pass. Accepted tokens are kept, and the first rejected one is "
    "replaced by a token sampled from the residual distribution, so the output distribution "
    "is unchanged. The speedup depends on how often the draft agrees with the target."
)


def make_sessions(n: int, turns: int, seed: int = 0) -> list[list[str]]:
    """n sessions of `turns` user messages each; the assistant replies are filled in live."""
    rng = random.Random(seed)
    sessions = []
    for i in range(n):
        city = rng.choice(CITIES)
        kind = i % 4
        if kind == 0:
            msgs = [f"What is the weather in {city}? Use the get_weather tool.",
                    f'Tool result: {{"city": "{city}", "temp": {rng.randint(-5, 35)}, "unit": "celsius"}}. '
                    "Now call get_weather again for the same city in fahrenheit.",
                    "Now search for the best museum in that city with the search tool."]
        elif kind == 1:
            msgs = [f"Add type hints and a docstring to this function. Reply with the code only.\n\n{CODE}",
                    "Rename `items` to `line_items` everywhere and reply with the full function again.",
                    "Now rewrite the loop as a sum() over a generator. Full function again."]
        elif kind == 2:
            msgs = [f"Convert this CSV to a markdown table:\n\n{CSV}",
                    "Add a column `office` with the value `remote` for everyone. Full table again.",
                    "Sort the rows by team, then by name. Full table again."]
        else:
            msgs = [f"Summarize in three bullet points:\n\n{DOC}",
                    "Rewrite the summary as one sentence.",
                    "Quote the sentence of the original text that mentions the residual distribution."]
        sessions.append(msgs[:turns])
    return sessions


def short_sessions(n: int, turns: int, seed: int = 0) -> list[Session]:
    """make_sessions' conversations as Sessions: the system prompt, then one user message a turn."""
    system = [{"role": "system", "content": SYSTEM}]
    return [Session(system, [[{"role": "user", "content": u}] for u in users])
            for users in make_sessions(n, turns, seed)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def one_request(client, url: str, route: str, body: dict, headers: dict) -> dict:
    """One streamed request to /v1/chat/completions or /v1/completions. `complete`: the stream
    gave a finish reason and its [DONE]; raises RuntimeError on an HTTP or in-stream error."""
    start = time.perf_counter()
    first = None
    text, spec, usage, finish, done, timings = "", {}, {}, None, False, {}
    async with client.stream("POST", url + route, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: ") or done:
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice["text"] if "text" in choice else choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
                finish = choice.get("finish_reason") or finish
            spec = chunk.get("spec_decode", spec)
            timings = chunk.get("timings") or timings
            if timings.get("draft_n"):  # llama-server's draft counts, in its last chunk
                spec = {"drafted": timings["draft_n"], "accepted": timings.get("draft_n_accepted", 0)}
    end = time.perf_counter()
    prompt_tokens = usage.get("prompt_tokens", 0)
    # prompt tokens the engine ran rather than found cached: specdec's usage, llama-server's timings
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    prefilled = timings.get("prompt_n", prompt_tokens - cached if cached is not None else 0)
    return {"latency": end - start, "ttft": (first or end) - start, "text": text, "spec": spec,
            "tokens": usage.get("completion_tokens", 0), "prompt_tokens": prompt_tokens,
            "prefilled": prefilled, "complete": done and finish is not None}


def request_body(target: Target, messages: list[dict], args, render) -> tuple[str, dict]:
    """(route, body) of one turn. Only specdec gets specdec's own fields (target.extra)."""
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.model is not None:
        body["model"] = args.model
    body.update({"ignore_eos": True} if args.ignore_eos else {})  # both engines take it
    if args.raw_prompt:
        route, body["prompt"] = "/v1/completions", render(messages)
    else:
        route, body["messages"] = "/v1/chat/completions", messages
    return route, {**body, **target.extra}


async def think(seconds: float) -> None:
    """An agent's pause between a reply and its next turn (its tools run, say)."""
    await asyncio.sleep(seconds)


async def run_config(target: Target, sessions: list[Session], concurrency: int, args, render=None) -> dict:
    """`concurrency` agents walk `sessions`, each one turn after another, pausing `args.think`
    seconds between turns. A failed request is an error and a reply that stops short is lost;
    either ends its session, whose turns left count as lost too."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    results: list[dict] = []
    failures = {"errors": 0, "lost": 0, "first_error": None}
    queue = list(enumerate(sessions))

    async def agent(client):
        while queue:
            index, session = queue.pop(0)
            messages = list(session.opening)
            for turn, added in enumerate(session.turns):
                messages = [*messages, *added]
                route, body = request_body(target, messages, args, render)
                try:
                    res = await one_request(client, target.url, route, body, target.headers)
                except (httpx.HTTPError, RuntimeError, ValueError) as e:
                    failures["errors"] += 1
                    failures["lost"] += len(session.turns) - turn - 1
                    failures["first_error"] = failures["first_error"] or f"{type(e).__name__}: {e}"[:300]
                    break
                if not res["complete"]:
                    failures["lost"] += len(session.turns) - turn
                    break
                res["key"] = f"{index}.{turn}"
                results.append(res)
                messages = [*messages, {"role": "assistant", "content": res["text"]}]
                if args.think and turn + 1 < len(session.turns):
                    await think(args.think)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        await asyncio.gather(*(agent(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {"engine": target.engine, "label": target.label, "concurrency": concurrency,
            "speculation": target.speculation, **_measures(results, wall), **failures}


def _measures(results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    drafted = sum(r["spec"].get("drafted", 0) for r in results)
    accepted = sum(r["spec"].get("accepted", 0) for r in results)
    steps = sum(r["spec"].get("steps", 0) for r in results)
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    latencies = [r["latency"] for r in results]
    return {
        "requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
        "tok_per_s": round(tokens / wall, 2),
        "latency_p50_s": round(percentile(latencies, 0.5), 4),
        "latency_p95_s": round(percentile(latencies, 0.95), 4),
        "latency_p99_s": round(percentile(latencies, 0.99), 4),
        "ttft_p50_s": round(percentile([r["ttft"] for r in results], 0.5), 4),
        "ttft_p99_s": round(percentile([r["ttft"] for r in results], 0.99), 4),
        "tpot_mean_s": round(statistics.fmean(tpot), 5) if tpot else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "tau": round(tokens / steps, 3) if steps else None,
        "prompt_tokens_max": max((r["prompt_tokens"] for r in results), default=0),
        "prefilled_tokens": sum(r.get("prefilled", 0) for r in results),
        "texts": {r["key"]: r["text"] for r in results},
    }


def spawn_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--target", args.target, "--port", "0",
           "--backend", args.backend, "--drafter", args.drafter, "--max-batch", str(args.max_batch),
           "--max-queue", "256", "--served-model-name", args.model]
    for option in args.backend_option:
        cmd += ["--backend-option", option]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            break
    else:
        raise SystemExit("loadbench: the server did not start:\n" + "".join(lines[-20:]))
    # Keep draining stderr so a chatty server never blocks on a full pipe.
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stderr], daemon=True).start()
    proc.tail = lines
    return proc, match.group(1)


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit("loadbench: the server exited:\n" + "".join(getattr(proc, "tail", [])[-20:]))
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("loadbench: the server did not become ready")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server; otherwise one is started with --target")
    p.add_argument("--target", default="smollm2-135m",
                   help="the model served, whose tokenizer and chat template the benchmark also uses")
    p.add_argument("--backend", default="auto",
                   help="as specdec serve (auto: native for Llama-family targets, else hf)")
    p.add_argument("--backend-option", action="append", default=[])
    p.add_argument("--drafter", default="ngram", help="the started server's default drafter")
    p.add_argument("--drafter-on", default=None,
                   help="drafter to request when speculation is on (default: server's)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--model", default="bench", help="served model name")
    p.add_argument("--api-key-env", default=None)
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--modes", default="on,off", help="speculation modes of every engine, in running order")
    p.add_argument("--sessions", type=int, default=16, help="sessions per configuration")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--think", type=float, default=0.0,
                   help="seconds an agent pauses between a reply and its next turn (its tools running): "
                        "other sessions' requests meet its idle cache")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="every reply runs to --max-tokens (ignore_eos), "
                   "so every configuration decodes as many tokens")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--workload", choices=("short", "long-agent"), default="short",
                   help="short: the built-in 3-turn chats; long-agent: support-agent sessions of 4-6k tokens")
    p.add_argument("--seed", type=int, default=0, help="the long-agent sessions' seed")
    p.add_argument("--raw-prompt", action="store_true",
                   help="send every turn as prompt text on /v1/completions, rendered by the benchmark")
    p.add_argument("--rounds", type=int, default=1, help="runs of every configuration; medians are reported")
    p.add_argument("--warmup", choices=("short", "sessions"), default="short",
                   help="before round 1, each target answers two short chats, or the first turn of every "
                        "session (then no engine's first configuration pays cold prefills the others skip)")
    p.add_argument("--plot", default=None,
                   help="draw tok/s and p95 latency against concurrency into this PNG (matplotlib)")
    p.add_argument("--peer", choices=("none", "llama-server"), default="none")
    p.add_argument("--llama-server", type=Path, default=llama_server.DEFAULT_BINARY,
                   help="the llama-server binary (scripts/bench/peers/build_llama_server.py builds it)")
    p.add_argument("--threads", type=int, default=2, help="llama-server's CPU threads (-t)")
    p.add_argument("--llama-slots", type=int, default=4, help="llama-server's slots (--parallel)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    procs: list[subprocess.Popen] = []
    try:
        model = _workload_model(args)
        sessions = _sessions(args, model)
        targets = _start_targets(args, model, procs)
        rows = _run_rounds(targets, sessions, args, _renderer(args, model))
    finally:
        for proc in procs:
            llama_server.stop(proc)
    summary = _report(rows, args)
    specdec_url = next((t.url for t in targets if t.engine == "specdec"), None)
    summary = {"url": specdec_url, "target": args.target if args.url is None else None,
               "backend": args.backend if args.url is None else None, **summary}
    summary["servers"] = [" ".join(map(str, proc.args)) for proc in procs]
    if args.plot:
        plot(summary["results"], args.plot)
        summary["plot"] = args.plot
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))


def _workload_model(args):
    """The target's tokenizer, GGUF path and window, where the workload, the raw prompts or a
    peer need them; None otherwise (the short chats of a plain run need nothing)."""
    if args.workload == "short" and not args.raw_prompt and args.peer == "none":
        return None
    return load_model(args.target)


def _sessions(args, model) -> list[Session]:
    if args.workload == "short":
        return short_sessions(args.sessions, args.turns)
    tokenizer = model.tokenizer
    try:
        return make_long_sessions(args.sessions, args.turns,
                                  lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
                                  seed=args.seed, reply_tokens=args.max_tokens, window=model.max_length)
    except ValueError as e:
        raise SystemExit(f"loadbench: {e}") from None


def _renderer(args, model):
    """messages -> prompt text with specdec's own chat-template code (what its chat route
    encodes), so that raw prompts are the text the chat route would have built."""
    if not args.raw_prompt:
        return None
    return lambda messages: render_chat(model.tokenizer, messages)


def _start_targets(args, model, procs: list[subprocess.Popen]) -> list[Target]:
    """specdec (started, or --url) and the peer's servers, ready; started processes go to `procs`."""
    modes = [m.strip() for m in args.modes.split(",")]
    headers = {"Authorization": f"Bearer {os.environ[args.api_key_env]}"} if args.api_key_env else {}
    if args.url is not None:
        args.model = None
        wait_ready(args.url, None)
    targets = []
    for mode in modes:  # a server per mode, so that no mode finds another's prompts cached
        proc, url = (None, args.url) if args.url is not None else spawn_server(args)
        if proc is not None:
            procs.append(proc)
            wait_ready(url, proc)
        fields = {"return_spec_decode": True}  # the per-request statistics are opt-in
        if mode == "off" or args.drafter_on is not None:
            fields["drafter"] = "none" if mode == "off" else args.drafter_on
        targets.append(Target("specdec", mode, "specdec " + ("spec" if mode == "on" else "plain"), url,
                              fields, headers))
    if args.peer == "llama-server":
        targets += _start_llama_servers(args, model, modes, procs)
    return targets


def _start_llama_servers(args, model, modes: list[str], procs: list[subprocess.Popen]) -> list[Target]:
    """One llama-server per mode (its speculation is a server flag, not a request field)."""
    if model.gguf_path is None:
        raise SystemExit(f"loadbench: llama-server needs a GGUF target; {args.target!r} is not one")
    spec_type = llama_server.SPEC_TYPE if "on" in modes else None
    no_webui = llama_server.check_binary(args.llama_server, spec_type)
    window = llama_server.context_window(model.gguf_path)
    started = []
    for mode in modes:
        config = llama_server.LlamaServerConfig(
            args.llama_server, model.gguf_path, window, threads=args.threads, slots=args.llama_slots,
            spec_type=llama_server.SPEC_TYPE if mode == "on" else None, no_webui=no_webui)
        proc, url = llama_server.start(config)
        procs.append(proc)
        label = "llama-server " + (llama_server.SPEC_TYPE if mode == "on" else "plain")
        started.append((Target("llama-server", mode, label, url), proc))
    for target, proc in started:
        wait_ready(target.url, proc)
    return [target for target, _ in started]


def _run_rounds(targets: list[Target], sessions: list[Session], args, render) -> list[dict]:
    """Every configuration once per round, engines in turns (load_rounds.schedule), after one
    warm-up per target; returns one row per configuration, medians over the rounds."""
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.warmup == "sessions":  # every server holds every session's opening before round 1
        warm_sessions, warm_c = [Session(s.opening, s.turns[:1]) for s in sessions], 1
    else:
        warm_sessions, warm_c = short_sessions(2, 1, seed=99), 2
    for target in targets:
        warm = asyncio.run(run_config(target, warm_sessions, warm_c, args, render))
        if warm["errors"] or warm["lost"]:
            print(f"warm-up of {target.label}: {warm['first_error']}", file=sys.stderr, flush=True)
    runs = []
    for round_, target, c in schedule(targets, levels, args.rounds):
        fresh = fresh_turns(sessions, variant(round_, c, levels))
        before = server_time.scrape(target.engine, target.url, target.headers)
        run = asyncio.run(run_config(target, fresh, c, args, render))
        after = server_time.scrape(target.engine, target.url, target.headers)
        run.update(server_time.split(before, after, run["wall_s"]))
        run["round"] = round_
        runs.append(run)
        print(f"round {round_} {target.label:22} c={c:<3} {run['tok_per_s']:8.1f} tok/s  "
              f"latency p50 {run['latency_p50_s']:.3f}s p95 {run['latency_p95_s']:.3f}s  "
              f"ttft p50 {run['ttft_p50_s']:.3f}s  accept {run['acceptance_rate']:.2f} tau {run['tau']}  "
              f"errors {run['errors']} lost {run['lost']}", file=sys.stderr, flush=True)
    return summarize(runs)


def _report(rows: list[dict], args: argparse.Namespace) -> dict:
    """Print the exact-match check and the table; return the summary (without the texts)."""
    agreement = first_turn_agreement(rows) if args.temperature == 0 else {}
    if args.temperature == 0 and rows:
        # Greedy: every configuration of an engine must reproduce its first one's replies exactly.
        mark_exact_matches(rows)
        print(f"\ngreedy replies equal to their engine's first configuration's: "
              f"{', '.join(r['exact_match'] for r in rows)}")
    for r in rows:
        r.pop("runs_texts")
    print("\n| engine | speculation | concurrency | tok/s | latency p50 (s) | p95 (s) | p99 (s) | "
          "TTFT p50 (s) | p99 (s) | TPOT (s) | accept | tau | errors | lost | exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {'on' if r['speculation'] else 'off'} | {r['concurrency']} | "
              f"{r['tok_per_s']} | {r['latency_p50_s']} | {r['latency_p95_s']} | {r['latency_p99_s']} | "
              f"{r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['tpot_mean_s']} | {r['acceptance_rate']} | "
              f"{r['tau']} | {r['errors']} | {r['lost']} | {r.get('exact_match', '–')} |")
    server_time.print_table(rows)
    summary = {"sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
               "workload": args.workload, "raw_prompt": args.raw_prompt, "rounds": args.rounds,
               "warmup": args.warmup,
               "peer": args.peer, "errors": sum(r["errors"] for r in rows),
               "lost": sum(r["lost"] for r in rows), "results": rows}
    if agreement:
        summary["first_turn_match_vs_specdec"] = agreement
        print(f"\nfirst-turn replies equal to specdec's: {agreement}")
    by = {(r["speculation"], r["concurrency"]): r["tok_per_s"] for r in rows if r["engine"] == "specdec"}
    for spec in (True, False):
        if (spec, 1) in by and (spec, 8) in by:
            key = "concurrent8_vs_serial_" + ("spec_on" if spec else "spec_off")
            summary[key] = round(by[(spec, 8)] / by[(spec, 1)], 3)
            print(f"\n8 concurrent vs serial (speculation {'on' if spec else 'off'}): "
                  f"{summary[key]}x aggregate tok/s")
    return summary


if __name__ == "__main__":
    main()
