"""Concurrency benchmark for `specdec serve`: agent-like sessions against a live server.

Each session is a short multi-turn agent conversation (tool-call JSON, code edits, tables,
summaries); every turn resends the conversation so far and streams the reply. `c` sessions
run at once. For every (speculation on/off, concurrency) pair the same sessions are replayed
and we report aggregate completion tokens/s, request latency p50/p99, time to first token
p50/p99 and TPOT, plus acceptance from the responses' `spec_decode`. The last line of stdout
is one JSON object.

    python -m specdec.bench.load --target smollm2-135m --concurrency 1,4,8,16
    python -m specdec.bench.load --url http://127.0.0.1:8000 --sessions 16

Speculation off means the request body carries `"drafter": "none"`; on uses the server's
default drafter (or --drafter-on). "serial vs 8" is the ratio of aggregate tokens/s at
concurrency 8 to concurrency 1 with speculation on.
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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def one_request(client, url: str, body: dict, headers: dict) -> dict:
    start = time.perf_counter()
    first = None
    text, spec, usage = "", {}, {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
            spec = chunk.get("spec_decode", spec)
    end = time.perf_counter()
    return {"latency": end - start, "ttft": (first or end) - start, "text": text, "spec": spec,
            "tokens": usage.get("completion_tokens", 0)}


async def run_config(url, sessions, concurrency, drafter, args, headers) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    results: list[dict] = []
    queue = list(enumerate(sessions))

    async def agent(client):
        while queue:
            index, turns = queue.pop(0)
            messages = [{"role": "system", "content": SYSTEM}]
            for turn, user in enumerate(turns):
                messages.append({"role": "user", "content": user})
                body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens,
                        "temperature": args.temperature, "stream": True,
                        "stream_options": {"include_usage": True},
                        "return_spec_decode": True}  # the per-request statistics are opt-in
                if drafter is not None:
                    body["drafter"] = drafter
                res = await one_request(client, url, body, headers)
                res["key"] = f"{index}.{turn}"
                results.append(res)
                messages = [*messages, {"role": "assistant", "content": res["text"]}]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        await asyncio.gather(*(agent(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    drafted = sum(r["spec"].get("drafted", 0) for r in results)
    accepted = sum(r["spec"].get("accepted", 0) for r in results)
    steps = sum(r["spec"].get("steps", 0) for r in results)
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return {
        "concurrency": concurrency, "speculation": drafter != "none", "requests": len(results),
        "tokens": tokens, "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 2),
        "latency_p50_s": round(percentile([r["latency"] for r in results], 0.5), 4),
        "latency_p99_s": round(percentile([r["latency"] for r in results], 0.99), 4),
        "ttft_p50_s": round(percentile([r["ttft"] for r in results], 0.5), 4),
        "ttft_p99_s": round(percentile([r["ttft"] for r in results], 0.99), 4),
        "tpot_mean_s": round(statistics.fmean(tpot), 5) if tpot else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "tau": round(tokens / steps, 3) if steps else None,
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
    p.add_argument("--target", default="smollm2-135m")
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
    p.add_argument("--modes", default="on,off")
    p.add_argument("--sessions", type=int, default=16, help="sessions per configuration")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = spawn_server(args)
    else:
        args.model = None
    headers = {"Authorization": f"Bearer {os.environ[args.api_key_env]}"} if args.api_key_env else {}
    try:
        wait_ready(url, proc)
        rows = _run_configs(url, args, headers)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    summary = _report(rows, args)
    summary = {"url": url, "target": args.target if proc else None, "backend": args.backend if proc else None,
               **summary}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))


def _run_configs(url: str, args: argparse.Namespace, headers: dict) -> list[dict]:
    """Every (speculation mode, concurrency) pair over the same sessions, after a warm-up."""
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    sessions = make_sessions(args.sessions, args.turns)
    asyncio.run(run_config(url, make_sessions(2, 1, seed=99), 2, None, args, headers))  # warm-up
    rows = []
    for mode in modes:
        drafter = "none" if mode == "off" else args.drafter_on
        for c in levels:
            row = asyncio.run(run_config(url, sessions, c, drafter, args, headers))
            rows.append(row)
            print(f"spec {mode:3} c={c:<3} {row['tok_per_s']:8.1f} tok/s  "
                  f"latency p50 {row['latency_p50_s']:.3f}s p99 {row['latency_p99_s']:.3f}s  "
                  f"ttft p50 {row['ttft_p50_s']:.3f}s p99 {row['ttft_p99_s']:.3f}s  "
                  f"accept {row['acceptance_rate']:.2f} tau {row['tau']}", file=sys.stderr, flush=True)
    return rows


def _report(rows: list[dict], args: argparse.Namespace) -> dict:
    """Print the exact-match check and the table; return the summary (without the texts)."""
    if args.temperature == 0 and rows:
        # Greedy: every configuration must reproduce the first one's replies exactly.
        reference = rows[0]["texts"]
        for r in rows:
            same = sum(r["texts"].get(key) == text for key, text in reference.items())
            r["exact_match"] = f"{same}/{len(reference)}"
        print(f"\ngreedy replies equal to the first configuration's: "
              f"{', '.join(r['exact_match'] for r in rows)}")
    for r in rows:
        r.pop("texts")
    print("\n| speculation | concurrency | tok/s | latency p50 (s) | p99 (s) | TTFT p50 (s) | p99 (s) | "
          "TPOT (s) | accept | tau | exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'on' if r['speculation'] else 'off'} | {r['concurrency']} | {r['tok_per_s']} | "
              f"{r['latency_p50_s']} | {r['latency_p99_s']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} | "
              f"{r['tpot_mean_s']} | {r['acceptance_rate']} | {r['tau']} | {r.get('exact_match', '–')} |")
    by = {(r["speculation"], r["concurrency"]): r["tok_per_s"] for r in rows}
    summary = {"sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens, "results": rows}
    for spec in (True, False):
        if (spec, 1) in by and (spec, 8) in by:
            key = "concurrent8_vs_serial_" + ("spec_on" if spec else "spec_off")
            summary[key] = round(by[(spec, 8)] / by[(spec, 1)], 3)
            print(f"\n8 concurrent vs serial (speculation {'on' if spec else 'off'}): "
                  f"{summary[key]}x aggregate tok/s")
    return summary


if __name__ == "__main__":
    main()
