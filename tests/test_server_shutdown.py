"""The event loop stays free and the server stops cleanly (issue 16), with real processes:
a full server refuses (429) before it tokenizes, a stuck traffic-log disk stalls nobody,
tokenization runs side by side, and SIGTERM drains: 503 to new requests, the running ones
finish within --shutdown-timeout (or end with an error at the deadline), exit status 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
import torch

import specdec.request as request_mod
from conftest import save_loaded, tiny_llama, tiny_tokenizer
from served_helpers import PROMPTS, ServerProcess, assert_error_shape
from specdec.serve.gateway import Gateway
from specdec.serve.protocol import CompletionRequest
from specdec.serve.settings import ServeConfig
from specdec.serve.tokenize import TokenizerPool
from specdec.traffic_log import QueuedTrafficLog, TrafficLog, read_traffic

HANG_GUARD_S = 180  # how long a server may take to exit after SIGTERM before the test calls it a hang
LONG_PROMPT = "fox " * 2000  # past the context: tokenizing it is the only way to find out


@pytest.fixture(scope="module")
def endless_model_dir(tmp_path_factory):
    """A tiny model that never ends a greedy reply on its own (EOS's output row is zero, so
    its logit 0 never beats the largest of the others): a request runs for its max_tokens."""
    loaded = tiny_llama(0, max_positions=1024)
    with torch.no_grad():
        for eos in loaded.eos_token_ids:
            loaded.model.lm_head.weight[eos].zero_()
    return save_loaded(loaded, tmp_path_factory.mktemp("endless-model"))


class Stream:
    """A streamed completion read in a thread: `started` once the first chunk arrived."""

    def __init__(self, url: str, max_tokens: int):
        self.started, self.lines = threading.Event(), []
        body = {"prompt": PROMPTS[1], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the stream did not start"

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.started.set()
        except httpx.HTTPError as e:
            self.lines.append(f"transport error: {e!r}")
            self.started.set()

    def chunks(self) -> list[dict]:
        return [json.loads(x) for x in self.lines if x.startswith("{")]


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    deadline = time.time() + timeout
    while not (value := predicate()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_full_server_refuses_before_tokenizing(endless_model_dir):
    """Fault 6: with every place taken, a request gets 429 with Retry-After before its prompt
    is tokenized: a prompt past the context is refused as 429, not found too long (400)."""
    srv = ServerProcess(endless_model_dir, "--max-batch", "1", "--max-queue", "0", "--drafter", "none")
    try:
        running = Stream(srv.url, 600)
        for prompt in (LONG_PROMPT, "hi"):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
            assert r.status_code == 429, r.text
            assert assert_error_shape(r.json(), 429)["type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1
        assert running.thread.is_alive()  # the refusals came while it ran
        running.thread.join(120)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    finally:
        srv.close()


def test_a_stuck_traffic_log_stalls_nobody(endless_model_dir, tmp_path):
    """Fault 6: the traffic log's current segment is a FIFO nobody reads, so opening it
    blocks forever. Written on the event loop (before), the first reply hung the server;
    written by the log's own thread, replies and /health go on."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    fifo = log_dir / "traffic-000001.jsonl"
    os.mkfifo(fifo)
    srv = ServerProcess(endless_model_dir, "--log-dir", str(log_dir), "--drafter", "none")
    reader = None
    try:
        for i in range(3):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 4},
                           timeout=20)
            assert r.status_code == 200
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # unblock the writer thread for shutdown
        srv.close()
        os.close(reader)


def test_the_traffic_log_queue_is_bounded_and_never_blocks(tmp_path):
    gate = threading.Event()

    class SlowLog(TrafficLog):
        def record(self, *args, **kwargs):
            gate.wait(60)
            super().record(*args, **kwargs)

    log = QueuedTrafficLog(SlowLog(tmp_path, 1 << 20), max_pending=2)
    outcomes: list[bool] = []
    caller = threading.Thread(target=lambda: outcomes.extend(log.record(f"prompt {i}", "output", {"i": i})
                                                             for i in range(6)))
    caller.start()
    caller.join(20)  # a hang guard: the writer stays stuck until the gate opens
    stuck = caller.is_alive()
    gate.set()
    assert not stuck, "a caller waited for the stuck writer"
    assert outcomes[:2] == [True, True] and not all(outcomes) and log.dropped >= 3
    while not log.record(lambda: "rendered by the writer", "output"):  # until the writer makes room
        time.sleep(0.01)
    log.close()
    prompts = [r["prompt"] for r in read_traffic(tmp_path)]
    assert prompts[:2] == ["prompt 0", "prompt 1"] and prompts[-1] == "rendered by the writer"


def test_tokenization_runs_side_by_side_with_its_own_tokenizers():
    """Fault 6: two requests tokenize at once (each waits for the other inside `encode`; a
    global lock around tokenization would deadlock them), each with its own tokenizer copy."""
    gw = Gateway(ServeConfig())
    gw.tokenizers = TokenizerPool(tiny_tokenizer(), workers=2)
    gw.vocab_size = len(tiny_tokenizer())
    both_inside = threading.Barrier(2, timeout=10)
    seen = []

    def encode(tokenizer, prompt, **kw):
        seen.append(id(tokenizer))
        both_inside.wait()
        return tokenizer.encode(prompt)

    def prompt_ids(body) -> list[int]:  # what build_request runs on a pool thread
        return gw.request(body, "completion").prepare(tiny_tokenizer(), set(),
                                                      encoder=gw.tokenizers.local()).prompt_ids

    async def two():
        body = CompletionRequest(prompt="The quick brown fox")
        return await asyncio.gather(*(gw.tokenizers.run(prompt_ids, body) for _ in range(2)))

    original, request_mod.encode = request_mod.encode, encode
    try:
        first, second = asyncio.run(two())
    finally:
        request_mod.encode = original
        gw.tokenizers.close()
    assert first == second == tiny_tokenizer().encode("The quick brown fox")
    assert len(set(seen)) == 2 and id(tiny_tokenizer()) not in seen


def test_sigterm_drains_running_requests_then_exits_0(endless_model_dir):
    srv = ServerProcess(endless_model_dir, "--drafter", "none", "--shutdown-timeout", "120")
    try:
        running = Stream(srv.url, 300)
        srv.proc.send_signal(signal.SIGTERM)
        health = wait_for(lambda: (r := httpx.get(srv.url + "/health", timeout=5)).status_code == 503 and r,
                          what="/health to report the drain")
        assert "shutting down" in health.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert assert_error_shape(r.json(), 503)["type"] == "unavailable_error"
        assert running.thread.is_alive(), "the running request ended before the checks: make it longer"
        running.thread.join(120)
        chunks = running.chunks()
        assert running.lines[-1] == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == 300
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert srv.proc.wait(HANG_GUARD_S) == 0
    finally:
        srv.close()


def test_sigterm_ends_what_still_runs_at_the_deadline(endless_model_dir):
    # a deadline of 0.1 s against 1000 tokens: this tiny model decodes ~1000 tok/s on a fast
    # CPU, where 1000 tokens against a 1 s deadline finished before it
    srv = ServerProcess(endless_model_dir, "--drafter", "none", "--shutdown-timeout", "0.1")
    try:
        running = Stream(srv.url, 1000)
        srv.proc.send_signal(signal.SIGTERM)
        # A hang guard, generous for a busy machine; the error below shows the deadline ended it.
        assert srv.proc.wait(HANG_GUARD_S) == 0
        running.thread.join(10)
        errors = [c["error"] for c in running.chunks() if "error" in c]
        assert (errors and errors[0]["code"] == 503
                and "shutting down" in errors[0]["message"]), running.lines[-3:]
    finally:
        srv.close()
