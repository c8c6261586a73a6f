"""Soak test of a real `specdec serve` process (issue 16): many concurrent clients, random
disconnects, long and short prompts mixed, malformed requests mixed in.

Each of `--clients` clients sends `--rounds` requests, one after another, each picked at random:
a greedy chat or completion (streamed mostly, some not), a stream the client drops after a few
chunks, a request the client gives up on before its answer, or a malformed body (broken JSON,
wrong types, a lone UTF-16 surrogate, unknown fields, a prompt longer than the context...).
Well-formed requests go through the official `openai` client, malformed ones through httpx.

Before the soak every prompt is asked alone, one at a time; that reply is the reference. The
soak passes when
- no response has status 5xx, nor does any stream carry an error event with a 5xx code;
- no reply is lost, hung (past `--request-timeout`) or mixed up: every greedy reply that
  completed equals its prompt's reference;
- every malformed request gets a 4xx;
- /health is 200 afterwards and one more request is served right;
- the server's RSS after the soak is within `--rss-bound-mb` of its RSS before it (after the
  references, which fill the caches once).
It reports the inter-token latency of running streams: the gaps between consecutive chunks
of each completed stream (a chunk is one decode step's tokens), p50 / p99 / max.

    python tests/soak.py --target DIR_OR_NAME [--server-arg=--max-batch=16 ...]  # spawns a server
    python tests/soak.py --url http://127.0.0.1:8000 --pid PID                   # a running one

The last line of stdout is one JSON object; the exit status is 0 when the soak passed.
RSS is read from /proc (Linux).
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
from dataclasses import dataclass, field

import httpx
import openai

SHORT = [
    "def add(a, b):\n    return a + b\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    '{"name": "search", "arguments": {"query": "weather in Paris"}} {"name": "search",',
    "| name | value |\n|------|-------|\n| a | 1 |\n| b |",
    "Speculative decoding drafts tokens and verifies them.",
    "The lazy dog",
]
WORDS = ["cache", "draft", "verify", "token", "batch", "stream", "queue", "tenant", "prefix", "chunk",
         "model", "reply"]

# Malformed bodies for /v1/chat/completions (raw bytes or JSON values): every one must get a 4xx.
MALFORMED: list[bytes | dict] = [
    b"{not json",
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate
    b'{"model": "m", "messages": [{"role": "user", "content": "a\\udfffb"}], "stream": true}',
    {"model": "m"},
    {"model": "m", "messages": []},
    {"model": "m", "messages": "hello"},
    {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 4},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "frobnicate": True},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 5}},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "top_p": 7},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 2**80},
    [1, 2, 3],
]


@dataclass
class Settings:
    clients: int = 64
    rounds: int = 3
    max_tokens: int = 24
    long_words: int = 600  # words in a long prompt
    long_prompts: int = 4
    long_share: float = 0.25  # of well-formed requests
    request_timeout: float = 180.0
    rss_bound_mb: float = 300.0
    seed: int = 0
    model: str = "tiny"
    api_key: str = "none"


@dataclass
class Tally:
    """What the soak saw; `failures` lists what breaks a pass criterion."""

    statuses: dict[str, int] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    dropped: int = 0
    gaps: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def status(self, code: int | str) -> None:
        key = str(code)
        self.statuses[key] = self.statuses.get(key, 0) + 1
        if isinstance(code, int) and code >= 500:
            self.failures.append(f"status {code}")


def long_prompt(rng: random.Random, words: int) -> str:
    """A long prompt no other request shares (no prefix cache helps it)."""
    return f"Note {rng.getrandbits(48):x}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def make_prompts(s: Settings) -> list[str]:
    rng = random.Random(s.seed)
    return SHORT + [long_prompt(rng, s.long_words) for _ in range(s.long_prompts)]


# ---- one request -------------------------------------------------------------------------------


def _body(prompt: str, chat: bool, s: Settings) -> dict:
    base = {"model": s.model, "max_tokens": s.max_tokens, "temperature": 0}
    return {**base, "messages": [{"role": "user", "content": prompt}]} if chat else {**base, "prompt": prompt}


def _text(chunk, chat: bool) -> str:
    if not chunk.choices:
        return ""
    return (chunk.choices[0].delta.content or "") if chat else (chunk.choices[0].text or "")


async def ask(client: openai.AsyncOpenAI, prompt: str, chat: bool, s: Settings, stream: bool,
              drop_after: int | None = None, gaps: list[float] | None = None) -> str | None:
    """One greedy request; the reply's text, or None when the client dropped the stream."""
    api = client.chat.completions if chat else client.completions
    if not stream:
        r = await api.create(**_body(prompt, chat, s))
        return r.choices[0].message.content if chat else r.choices[0].text
    text, last, chunks = "", None, 0
    async with await api.create(**_body(prompt, chat, s), stream=True) as events:
        async for chunk in events:
            piece = _text(chunk, chat)
            if not piece:
                continue
            now = time.perf_counter()
            if last is not None and gaps is not None:
                gaps.append(now - last)
            last, chunks, text = now, chunks + 1, text + piece
            if drop_after is not None and chunks >= drop_after:
                return None  # leaving the block closes the connection mid-stream
    return text


async def malformed(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = rng.choice(MALFORMED)
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = await http.post("/v1/chat/completions", **kw)
    tally.status(r.status_code)
    if not 400 <= r.status_code < 500:
        tally.failures.append(f"malformed body {body!r:.80} got {r.status_code}")
    elif "error" not in r.json():
        tally.failures.append(f"malformed body {body!r:.80}: not an OpenAI error shape")


async def one_round(client, http, rng: random.Random, prompts: list[str], expected: dict, s: Settings,
                    tally: Tally) -> None:
    mode = rng.choices(["stream", "plain", "drop", "give_up", "malformed"], [5, 1, 2, 1, 2])[0]
    tally.modes[mode] = tally.modes.get(mode, 0) + 1
    if mode == "malformed":
        return await malformed(http, rng, tally)
    long = rng.random() < s.long_share
    prompt = rng.choice(prompts[len(SHORT):] if long else prompts[: len(SHORT)])
    chat = rng.random() < 0.5
    try:
        if mode == "give_up":  # the client goes away before the answer
            await ask(client.with_options(timeout=rng.uniform(0.05, 0.5)), prompt, chat, s, stream=False)
            reply = None
        else:
            gaps: list[float] = []
            drop = rng.randint(1, 3) if mode == "drop" else None
            reply = await ask(client, prompt, chat, s, mode != "plain", drop, gaps)
            tally.gaps += gaps
    except openai.APITimeoutError:
        if mode != "give_up":
            tally.failures.append(f"hung: {mode} {prompt[:40]!r} past {s.request_timeout}s")
        tally.dropped += 1
        return None
    except openai.APIStatusError as e:
        tally.status(e.status_code)
        if e.status_code != 429:
            tally.failures.append(f"{mode} {prompt[:40]!r}: {e.status_code} {str(e)[:200]}")
        return None
    except openai.APIError as e:  # an error event inside a stream
        code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        tally.status(code if isinstance(code, int) else "stream_error")
        tally.failures.append(f"stream error: {mode} {prompt[:40]!r}: {str(e)[:200]}")
        return None
    tally.status(200)
    if reply is None:
        tally.dropped += 1
    elif reply != expected[(prompt, chat)]:
        tally.failures.append(f"mixed up: {mode} {'chat' if chat else 'completion'} {prompt[:40]!r}: "
                              f"{reply[:60]!r} != {expected[(prompt, chat)][:60]!r}")
    else:
        tally.completed += 1
    return None


# ---- the soak ----------------------------------------------------------------------------------


def _clients(url: str, s: Settings) -> tuple[openai.AsyncOpenAI, httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=4 * s.clients, max_keepalive_connections=2 * s.clients)
    pool = httpx.AsyncClient(limits=limits, timeout=s.request_timeout)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=s.api_key, max_retries=0,
                                timeout=s.request_timeout, http_client=pool)
    http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {s.api_key}"}, limits=limits,
                             timeout=s.request_timeout)
    return client, http


async def references(url: str, prompts: list[str], s: Settings) -> dict:
    """Each prompt's greedy reply served alone, as chat and as completion."""
    client, http = _clients(url, s)
    async with http:
        return {(p, chat): await ask(client, p, chat, s, stream=False)
                for p in prompts for chat in (True, False)}


async def soak(url: str, prompts: list[str], expected: dict, s: Settings) -> Tally:
    client, http = _clients(url, s)
    tally = Tally()

    async def run_client(i: int) -> None:
        rng = random.Random(s.seed * 1000 + i)
        await asyncio.sleep(rng.uniform(0, 1.0))  # arrivals spread over a second
        for _ in range(s.rounds):
            await one_round(client, http, rng, prompts, expected, s, tally)

    async with http:
        await asyncio.gather(*(run_client(i) for i in range(s.clients)))
    return tally


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def check_after(url: str, prompts: list[str], expected: dict, s: Settings, tally: Tally) -> None:
    """/health is 200 once the server settles, and it still serves the references."""
    deadline, status = time.time() + 30, None
    while time.time() < deadline:
        status = httpx.get(url + "/health", timeout=10).status_code
        if status == 200:
            break
        time.sleep(0.2)
    if status != 200:
        tally.failures.append(f"/health is {status} after the soak")
    again = asyncio.run(references(url, prompts[:1], s))
    if again[(prompts[0], True)] != expected[(prompts[0], True)]:
        tally.failures.append("a request after the soak got another reply")


def run(url: str, pid: int | None, s: Settings) -> dict:
    """The whole soak against a ready server; returns the report (report["passed"])."""
    prompts = make_prompts(s)
    t0 = time.perf_counter()
    expected = asyncio.run(references(url, prompts, s))
    rss_before = rss_mb(pid)
    t1 = time.perf_counter()
    tally = asyncio.run(soak(url, prompts, expected, s))
    soak_s = time.perf_counter() - t1
    check_after(url, prompts, expected, s, tally)
    time.sleep(1.0)  # let the worker release what the last requests held
    rss_after = rss_mb(pid)
    if rss_before is not None and rss_after - rss_before > s.rss_bound_mb:
        tally.failures.append(f"RSS grew {rss_after - rss_before:.0f} MB (bound {s.rss_bound_mb:.0f})")
    well_formed = sum(n for m, n in tally.modes.items() if m != "malformed")
    if tally.completed < well_formed // 4:
        tally.failures.append(f"only {tally.completed} of {well_formed} requests completed")
    gaps_ms = [g * 1000 for g in tally.gaps]
    return {
        "passed": not tally.failures, "failures": tally.failures[:20], "num_failures": len(tally.failures),
        "clients": s.clients, "requests": sum(tally.modes.values()), "modes": tally.modes,
        "statuses": tally.statuses, "completed_equal_to_alone": tally.completed, "dropped": tally.dropped,
        "references_s": round(t1 - t0, 1), "soak_s": round(soak_s, 1),
        "rss_mb_before": rss_before and round(rss_before), "rss_mb_after": rss_after and round(rss_after),
        "itl_ms": {"n": len(gaps_ms), "p50": gaps_ms and round(statistics.median(gaps_ms), 1),
                   "p99": gaps_ms and round(percentile(gaps_ms, 0.99), 1),
                   "max": gaps_ms and round(max(gaps_ms), 1)},
    }


# ---- a server process --------------------------------------------------------------------------


class ServerProcess:
    """`specdec serve --port 0` as a child process; `lines` holds its stderr."""

    def __init__(self, target: str, args: list[str], env: dict | None = None, timeout: float = 300):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        cmd = [sys.executable, "-m", "specdec.cli", "serve", "--target", target, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self.lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(timeout):
            self.close()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))
        self.url = "http://127.0.0.1:" + re.search(r"http://127\.0\.0\.1:(\d+)", "".join(self.lines)).group(1)
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError("server did not become ready:\n" + "".join(self.lines[-40:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on" in line:
                self._listening.set()

    @property
    def tracebacks(self) -> int:
        return sum("Traceback" in line for line in self.lines)

    def close(self) -> int | None:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="spawn `specdec serve --target TARGET` (a model directory or name)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra serve flag, e.g. --server-arg=--max-batch=16")
    p.add_argument("--url", help="soak a running server instead")
    p.add_argument("--pid", type=int, help="the running server's pid, for its RSS")
    for name, value in vars(Settings()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    s = Settings(**{k: getattr(args, k) for k in vars(Settings())})
    server = None
    if args.url is None:
        if args.target is None:
            p.error("give --target (spawn a server) or --url")
        server = ServerProcess(args.target, ["--served-model-name", s.model, "--drafter", "ngram:min=1",
                                             "--max-queue", str(4 * s.clients), *args.server_arg])
    try:
        report = run(args.url or server.url, args.pid if server is None else server.proc.pid, s)
    finally:
        if server is not None:
            exit_code = server.close()
    if server is not None:
        report["server_tracebacks"] = server.tracebacks
        report["server_exit_code"] = exit_code
    print(json.dumps(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
