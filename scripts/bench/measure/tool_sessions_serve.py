"""Tool-calling agent sessions through two real `specdec serve` processes, one after the other:
plain decoding (drafter none, k = 0, a grammar's forced tokens scored one per forward) and the
agent setup of examples/agents.yaml. Every turn goes through the official `openai` client with
the session's `tools` and `tool_choice`; the model's calls and the scripted tool results are fed
back as the next turn's history (fixed call ids, so both servers see the same prompts).

Reports completion tokens per second (all turns' completion tokens over their request time),
the speedup, the valid-call rate and whether every reply is identical. The last line of stdout
is one JSON object.

    python scripts/bench/measure/tool_sessions_serve.py [--config examples/agents.yaml] [--limit 8]
        [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import yaml

from specdec.bench.run import DEFAULT_DATA, load_questions
from specdec.bench.tool_sessions import reply_is_valid

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import served  # noqa: E402 - scripts/bench/served.py


def spawn(config: Path) -> tuple[subprocess.Popen, str]:
    return served.spawn(["--config", str(config)])


def run_session(client: openai.OpenAI, session, max_tokens: int) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": session.system}] if session.system else []
    replies = []
    for ti, turn in enumerate(session.turns):
        if turn.user is not None:
            messages.append({"role": "user", "content": turn.user})
        t0 = time.perf_counter()
        response = client.chat.completions.create(
            model="smollm2-135m", messages=messages, tools=session.tools, tool_choice=turn.tool_choice,
            parallel_tool_calls=False, temperature=0, max_tokens=max_tokens, seed=ti,
        )
        elapsed = time.perf_counter() - t0
        message = response.choices[0].message
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
        ids = [f"call_{ti + 1}_{j + 1}" for j in range(len(calls))]
        reply = {"role": "assistant", "content": message.content}
        if calls:
            reply["tool_calls"] = [{"id": i, "type": "function", "function": c} for i, c in zip(ids, calls, strict=True)]
        messages.append(reply)
        if turn.result is not None:
            text = turn.result if isinstance(turn.result, str) else json.dumps(turn.result)
            messages += [{"role": "tool", "tool_call_id": i, "content": text} for i in ids or [f"call_{ti + 1}_0"]]
        replies.append({
            "content": message.content, "calls": calls, "seconds": elapsed,
            "tokens": response.usage.completion_tokens, "finish": response.choices[0].finish_reason,
            "valid": reply_is_valid(calls, session.tools, turn.tool_choice) if turn.must_call else None,
        })
    return replies


def serve_and_run(config: Path, sessions, max_tokens: int, repeat: int) -> list[list[dict]]:
    proc, url = spawn(config)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
        run_session(client, sessions[0], max_tokens)  # warm-up (the run's budget: a tool call needs room to close)
        runs = [[run_session(client, s, max_tokens) for s in sessions] for _ in range(repeat)]
        return runs[-1] if repeat == 1 else [sum((r[i] for r in runs), []) for i in range(len(sessions))]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def summary(results: list[list[dict]]) -> dict:
    turns = [t for session in results for t in session]
    tokens, seconds = sum(t["tokens"] for t in turns), sum(t["seconds"] for t in turns)
    judged = [t["valid"] for t in turns if t["valid"] is not None]
    return {"turns": len(turns), "completion_tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_second": round(tokens / seconds, 2), "valid_calls": f"{sum(judged)}/{len(judged)}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "examples" / "agents.yaml"))
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--limit", type=int, default=None, help="at most this many sessions")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeat", type=int, default=1, help="passes over the sessions per server (timed: all)")
    args = p.parse_args()
    sessions = [q.session for q in load_questions(args.data, ["tool_sessions"], args.limit)]
    spec_file = Path(args.config)
    plain = yaml.safe_load(spec_file.read_text())
    plain.update({"propose_model": "none", "num_propose_tokens": 0, "draft_forced": False})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(plain, f)
    results = {"plain": serve_and_run(Path(f.name), sessions, args.max_tokens, args.repeat),
               "speculative": serve_and_run(spec_file, sessions, args.max_tokens, args.repeat)}
    out = {name: summary(r) for name, r in results.items()}
    same = [a["content"] == b["content"] and a["calls"] == b["calls"]
            for sa, sb in zip(results["plain"], results["speculative"], strict=True) for a, b in zip(sa, sb, strict=True)]
    out["identical_replies"] = f"{sum(same)}/{len(same)}"
    out["speedup"] = round(out["speculative"]["tokens_per_second"] / out["plain"]["tokens_per_second"], 2)
    for name in ("plain", "speculative"):
        s = out[name]
        print(f"{name:12s} {s['tokens_per_second']:7.1f} tok/s  {s['completion_tokens']} tokens in {s['seconds']} s  "
              f"valid calls {s['valid_calls']}")
    print(f"speedup {out['speedup']:.2f}x, identical replies {out['identical_replies']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
