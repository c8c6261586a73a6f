"""The shipped agent sessions (bench.jsonl: `agent_sessions` and `tool_sessions`) run as
concurrent conversations through `specdec serve` set up several ways, one after the other:

- single:   the one-process server (no Ray);
- ray1:     one replica on Ray Serve (`--replicas 1 --ray-address local`): Ray's own overhead;
- affinity: two replicas, session-affine routing (the default);
- random:   two replicas, each request to a random replica.

Per setup: the prefix-cache hit rate (cached / prompt tokens), tau (tokens per target forward,
bonus included) and the drafter's acceptance rate, completion throughput, p50/p99 request
latency, and how many replies equal the first setup's (greedy: all should). Speculation is
not throttled (`--max-batch-tokens 0`) and k is fixed, so tau depends on the drafter's state
only: one
replica holds every conversation's suffix statistics (what merging replicas' statistics
would give at best), two replicas hold half each.

    python scripts/bench/measure/ray_affinity_bench.py [--modes affinity,random,single,ray1] [--limit 3]
        [--max-tokens 64]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from specdec.bench.run import DEFAULT_DATA, load_questions

MODES = {
    "single": [],
    "ray1": ["--replicas", "1", "--ray-address", "local"],
    "affinity": ["--replicas", "2"],
    "random": ["--replicas", "2", "--routing", "random"],
}
MODEL = "bench"


def spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--port", "0", "--served-model-name", MODEL, *args]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "specdec serve: ready" in line:
                ready.set()
        ready.set()  # exited

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(900) or proc.poll() is not None:
        proc.kill()
        raise SystemExit("the server did not start:\n" + "".join(lines[-20:]))
    url = re.search(r"listening on (http://\S+)", "".join(lines)).group(1)
    while httpx.get(url + "/health", timeout=10).status_code != 200:
        time.sleep(0.5)
    return proc, url


def run_conversation(client: openai.OpenAI, question, max_tokens: int) -> list[dict]:
    """One conversation's turns in order, each continuing from the model's own replies."""
    session = getattr(question, "session", None)
    messages = [{"role": "system", "content": session.system}] if session and session.system else []
    turns = session.turns if session else [type("Turn", (), {"user": t, "result": None}) for t in question.turns]
    out = []
    for ti, turn in enumerate(turns):
        if turn.user is not None:
            messages.append({"role": "user", "content": turn.user})
        extra = {"tools": session.tools, "tool_choice": turn.tool_choice, "parallel_tool_calls": False} if session else {}
        t0 = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens,
            extra_body={"return_spec_decode": True}, **extra)
        latency = time.perf_counter() - t0
        response = raw.parse()
        message = response.choices[0].message
        reply = {"role": "assistant", "content": message.content}
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
        ids = [f"call_{ti + 1}_{j + 1}" for j in range(len(calls))]
        if calls:
            reply["tool_calls"] = [{"id": i, "type": "function", "function": c} for i, c in zip(ids, calls, strict=True)]
        messages.append(reply)
        if turn.result is not None:
            text = turn.result if isinstance(turn.result, str) else json.dumps(turn.result)
            messages += [{"role": "tool", "tool_call_id": i, "content": text} for i in ids or [f"call_{ti + 1}_0"]]
        usage = response.usage
        out.append({
            "latency": latency, "replica": raw.headers.get("x-specdec-replica", "0"), "reply": [message.content, calls],
            "prompt": usage.prompt_tokens, "completion": usage.completion_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0,
            "spec": response.model_extra.get("spec_decode") or {},
        })
    return out


def measure(mode: str, server_args: list[str], questions, max_tokens: int) -> tuple[dict, list]:
    proc, url = spawn([*server_args, *MODES[mode]])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=1800, max_retries=0)
        for i in range(4):  # warm-up, every replica likely: first-request costs stay out of the timing
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {i}."}],
                                           max_tokens=4, temperature=0, user=f"warmup-{i}")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(questions)) as pool:
            results = list(pool.map(lambda q: run_conversation(client, q, max_tokens), questions))
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return summarize(results, wall), results


def summarize(results: list[list[dict]], wall: float) -> dict:
    turns = [t for conversation in results for t in conversation]
    steps = sum(t["spec"].get("steps", 0) for t in turns)
    tau = sum(t["spec"].get("mean_accepted_length", 0) * t["spec"].get("steps", 0) for t in turns) / max(steps, 1)
    drafted = sum(t["spec"].get("drafted", 0) for t in turns)
    latencies = sorted(t["latency"] for t in turns)
    split = [len({t["replica"] for t in conversation}) == 1 for conversation in results]
    return {
        "requests": len(turns), "wall_s": round(wall, 1),
        "completion_tok_per_s": round(sum(t["completion"] for t in turns) / wall, 2),
        "p50_latency_s": round(statistics.median(latencies), 2),
        "p99_latency_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
        "prefix_cache_hit_rate": round(sum(t["cached"] for t in turns) / max(1, sum(t["prompt"] for t in turns)), 4),
        "tau": round(tau, 3),
        "acceptance_rate": round(sum(t["spec"].get("accepted", 0) for t in turns) / max(drafted, 1), 4),
        "conversations_on_one_replica": f"{sum(split)}/{len(split)}",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", default="suffix")
    p.add_argument("--k", default="8", help="a fixed draft length: adaptive k would also read each server's timing")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--limit", type=int, default=None, help="at most this many sessions per category")
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown mode(s): {', '.join(unknown)}")
    questions = load_questions(DEFAULT_DATA, ["agent_sessions", "tool_sessions"], args.limit)
    server_args = ["--target", args.target, "--drafter", args.drafter, "--k", args.k, "--max-batch-tokens", "0",
                   "--max-batch", str(len(questions))]
    out, first = {}, None
    for mode in modes:
        out[mode], results = measure(mode, server_args, questions, args.max_tokens)
        replies = [t["reply"] for conversation in results for t in conversation]
        first = first or replies
        out[mode]["replies_as_first_mode"] = f"{sum(a == b for a, b in zip(replies, first, strict=True))}/{len(first)}"
        s = out[mode]
        print(f"{mode:9s} {s['completion_tok_per_s']:6.1f} tok/s  p50 {s['p50_latency_s']:5.2f} s  "
              f"p99 {s['p99_latency_s']:5.2f} s  prefix hits {s['prefix_cache_hit_rate']:.1%}  tau {s['tau']:.2f}  "
              f"accept {s['acceptance_rate']:.1%}  one replica {s['conversations_on_one_replica']}", flush=True)
    print(json.dumps({"sessions": len(questions), "max_tokens": args.max_tokens, "drafter": args.drafter, **out}))


if __name__ == "__main__":
    main()
