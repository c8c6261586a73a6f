"""The OpenAI gateway as a real server process on 127.0.0.1, driven by the official client.

One server (tiny random model, API key, traffic log) serves most tests; a second one with a
one-request capacity checks back-pressure. The load test runs 32 concurrent clients, some of
which disconnect, and checks that every completed greedy response equals the single-request
output and that disconnected requests never finish (their cache slots were freed).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import save_loaded, tiny_llama

KEY = "sk-test-key"
TESTS = str(Path(__file__).parent)
MODEL = "tiny"


class ServerProcess:
    """A real `specdec serve` on a free port. The tiny random models run on the hf backend by
    default (what their expected replies are computed with); pass backend="auto" for the
    server's own default."""

    def __init__(self, model_dir: str, *args: str, env: dict | None = None, backend: str = "hf",
                 plugin: str | None = None):
        """`plugin`: a module of tests/ imported before the server starts (it may register a drafter)."""
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        if "--backend" not in args:
            args = ("--backend", backend, *args)
        boot = f"import sys; sys.path.insert(0, {TESTS!r}); import {plugin}; " if plugin else "import sys; "
        boot += "from specdec.cli import main; main(sys.argv[1:])"
        cmd = [sys.executable, "-c", boot, "serve", "--target", model_dir, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env)
        self.lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(180):  # importing torch takes long on a loaded machine
            self.close()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        port = re.search(r"http://127\.0\.0\.1:(\d+)", "".join(self.lines)).group(1)
        self.url = f"http://127.0.0.1:{port}"
        self.health: list[tuple[int, dict]] = []  # (status, body) seen while waiting for ready
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                self.health.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.close()
        raise RuntimeError("server did not become ready:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on" in line:
                self._listening.set()

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def metrics(self) -> dict[str, float]:
        """Sample name (labels included, model_name left out: every sample must carry it) -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("specdec:"):
                name, _, value = line.rpartition(" ")
                assert re.search(r'model_name="[^"]+"', name), line
                name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
                values[name] = float(value)
        return values


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_loaded(tiny_llama(0), tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("traffic"))


@pytest.fixture(scope="module")
def server(model_dir, log_dir):
    srv = ServerProcess(
        model_dir, "--served-model-name", MODEL, "--api-key-env", "SPECDEC_TEST_KEY", "--drafter", "ngram:min=1",
        "--max-batch", "8", "--log-dir", log_dir,
        env={"SPECDEC_TEST_KEY": KEY, "SPECDEC_SERVE_LOAD_DELAY": "1.0"},
    )
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    '{"name": "search", "arguments": {"query": "weather in Paris"}} {"name": "search",',
    "| name | value |\n|------|-------|\n| a | 1 |\n| b |",
]


def assert_error_shape(body: dict, status: int) -> dict:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    return err


# ---- basics ---------------------------------------------------------------------------------


def test_health_is_503_while_loading_then_200(server):
    loading = [body for status, body in server.health if status == 503]
    assert loading, server.health
    assert loading[0]["error"]["message"] == "Loading model"
    assert loading[0]["error"]["type"] == "unavailable_error"
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_models_and_api_key(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 256
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert_error_shape(r.json(), 401)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # open, like vLLM
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_chat_streamed_equals_not_streamed(client):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                          extra_body={"return_spec_decode": True})
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens == 20 or full.choices[0].finish_reason == "stop"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    spec = full.model_extra["spec_decode"]
    assert spec["steps"] >= 1 and set(spec) >= {"drafted", "accepted", "acceptance_rate", "mean_accepted_length"}

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    without_usage = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True))
    assert all(c.usage is None for c in without_usage)


def test_completions_equal_the_target_and_stop_strings(model_dir, client):
    from specdec.engine import Engine
    from specdec.models import load_model

    plain = Engine(load_model(model_dir), drafter="none", k=0)
    want = plain.generate(PROMPTS[1], max_new_tokens=24, chat=False)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)

    # A stop string that first appears at position i cuts the text there, streamed or not.
    text = want.text
    i = next(i for i in range(3, len(text) - 2) if text.find(text[i : i + 2]) == i and "\ufffd" not in text[i : i + 2])
    stop = text[i : i + 2]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop, "zzzz"])
    assert cut.choices[0].text == text[:i] and cut.choices[0].finish_reason == "stop"
    pieces = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == text[:i]


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, seed=seed)
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_extra_body_drafter_and_k(client):
    base = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    off = client.completions.create(**base, extra_body={"drafter": "none", "return_spec_decode": True})
    on = client.completions.create(**base, extra_body={"drafter": "ngram", "k": 4})
    assert off.model_extra["spec_decode"]["drafted"] == 0
    assert off.model_extra["spec_decode"]["drafter"] == "none"
    assert "spec_decode" not in on.model_extra  # opt-in: a caller sees its statistics only when it asks
    assert on.choices[0].text == off.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**base, extra_body={"drafter": "model:/etc"})
    assert info.value.body["param"] == "drafter"


# ---- errors ---------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("chat", b"{not json", None),
    ("chat", b"[1, 2]", None),
    ("chat", {}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": MSG, "model": "gpt-4"}, "model"),
    ("chat", {"messages": MSG, "model": "x" * 5000}, "model"),  # the error does not echo it
    ("chat", {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": MSG, "max_tokens": 1000}, "max_tokens"),
    ("chat", {"messages": MSG, "max_completion_tokens": -3}, "max_completion_tokens"),
    ("chat", {"messages": MSG, "temperature": 2.5}, "temperature"),
    ("chat", {"messages": MSG, "temperature": -0.1}, "temperature"),
    ("chat", {"messages": MSG, "top_p": 0}, "top_p"),
    ("chat", {"messages": MSG, "top_p": 1.5}, "top_p"),
    ("chat", {"messages": MSG, "n": 2}, "n"),
    ("chat", {"messages": MSG, "k": -1}, "k"),
    ("chat", {"messages": MSG, "drafter": "no-such"}, "drafter"),
    ("chat", {"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"messages": [{"role": "user", "content": "fox " * 300}]}, "messages"),
    ("completions", {"prompt": "fox " * 300}, "prompt"),
    ("completions", {"prompt": [1, 2, 10**6]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize("route,body,param", BAD)
def test_bad_requests_get_openai_shaped_400s(http, route, body, param):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = assert_error_shape(r.json(), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if isinstance(body, dict) and ("fox " * 300 in json.dumps(body) or body.get("max_tokens") == 1000):
        assert "maximum context length" in err["message"]
    assert len(r.content) < 2048


def test_openai_client_sees_bad_request_and_size_limits(server, client, http):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=3)
    assert info.value.body["param"] == "temperature"
    r = http.post("/v1/completions", content=b"x" * (9 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and assert_error_shape(r.json(), 413)
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and assert_error_shape(r.json(), 404)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bad"]) | JSON},
    optional={"content": st.text(max_size=40) | JSON | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2)},
)
FIELDS = {
    "model": st.sampled_from([MODEL, "other"]) | JSON,
    "max_tokens": st.integers(-2, 6) | st.sampled_from([10**9, "4", 2.5]),
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON,
    "top_k": st.integers(-3, 500),
    "n": st.integers(-1, 3),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=300), max_size=20) | JSON,
    "seed": st.integers(-(2**65), 2**65),
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "drafter": st.sampled_from(["none", "ngram", "ngram:k=3", "model:x", "zz", ""]) | JSON,
    "k": st.integers(-2, 100) | st.just("auto") | JSON,
    "presence_penalty": st.floats(-3, 3),
    "extra_field": JSON,
}
CHAT_BODY = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=3) | JSON}, optional=FIELDS)
COMPLETION_BODY = st.fixed_dictionaries(
    {"prompt": st.text(max_size=60) | st.lists(st.integers(-5, 500), max_size=20) | JSON},
    optional={**FIELDS, "echo": st.booleans(), "best_of": st.integers(0, 3), "suffix": st.text(max_size=3)},
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), chat_body=CHAT_BODY, completion_body=COMPLETION_BODY)
def test_fuzzed_bodies_never_get_a_5xx(http, chat, chat_body, completion_body):
    body = chat_body if chat else completion_body
    if body.get("max_tokens") is None or body.get("max_tokens") == 10**9:
        body = {**body, "max_tokens": 4} if isinstance(body, dict) else body  # keep the run short
    r = http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code < 500, (body, r.text)
    assert r.status_code in (200, 400), (body, r.status_code, r.text)
    if r.status_code == 400:
        assert_error_shape(r.json(), 400)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# ---- load -----------------------------------------------------------------------------------


def test_32_concurrent_clients_with_disconnects(server, http):
    """Every completed greedy response equals the single-request output; requests whose
    client went away never finish (the worker dropped them and freed their cache)."""
    expected = {}
    for p in PROMPTS:
        r = http.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0})
        expected[p] = r.json()["choices"][0]["text"]
    before = server.metrics()
    done_before = sum(v for k, v in before.items() if k.startswith("specdec:request_success_total"))
    rng = random.Random(0)
    plans = [(PROMPTS[i % 4], rng.choice(["plain", "stream", "plain", "stream", "drop_stream", "drop_wait"]))
             for i in range(64)]

    def client_run(plan) -> tuple[str, str | None]:
        prompt, mode = plan
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
            if mode == "drop_wait":  # give up before the answer: the client closes the connection
                try:
                    c.post("/v1/completions", json={**body, "max_tokens": 200}, timeout=0.05)
                except httpx.TimeoutException:
                    return mode, None
                return "finished_anyway", None
            if mode == "drop_stream":
                with c.stream("POST", "/v1/completions", json={**body, "max_tokens": 200, "stream": True}) as r:
                    next(r.iter_lines())
                return mode, None
            if mode == "stream":
                text = ""
                with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text += json.loads(line[6:])["choices"][0]["text"]
                return mode, text
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return mode, r.json()["choices"][0]["text"]

    start = time.time()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client_run, plans))
    assert time.time() - start < 150
    completed = 0
    for (prompt, _), (mode, text) in zip(plans, results, strict=True):
        if mode in ("plain", "stream"):
            assert text == expected[prompt], (mode, prompt)
            completed += 1
    assert completed >= 20 and any(m.startswith("drop") for m, _ in results)

    deadline = time.time() + 30
    while time.time() < deadline:
        m = server.metrics()
        if m["specdec:num_requests_running"] == 0 and m["specdec:num_requests_waiting"] == 0:
            break
        time.sleep(0.2)
    assert m["specdec:num_requests_running"] == 0 and m["specdec:num_requests_waiting"] == 0
    done = sum(v for k, v in m.items() if k.startswith("specdec:request_success_total")) - done_before
    aborted = sum(v for k, v in m.items() if k.startswith("specdec:num_requests_aborted_total")) - sum(
        v for k, v in before.items() if k.startswith("specdec:num_requests_aborted_total"))  # fmt: skip
    # every request ends once, as a success or an abort (a dropped one may have finished first)
    assert done + aborted == len(plans) and aborted <= sum(mode.startswith("drop") for mode, _ in results)
    assert done >= completed + sum(mode == "finished_anyway" for mode, _ in results)
    assert m['specdec:batch_size_bucket{le="1.0"}'] < m["specdec:batch_size_count"]  # batched steps
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_and_traffic_log(server, client, log_dir):
    client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0)
    m = server.metrics()
    for name in (
        "specdec:spec_decode_num_drafts_total", "specdec:spec_decode_num_draft_tokens_total",
        "specdec:spec_decode_num_accepted_tokens_total", "specdec:e2e_request_latency_seconds_count",
        "specdec:time_to_first_token_seconds_count", "specdec:num_requests_waiting", "specdec:num_requests_running",
        "specdec:generation_tokens_total", "specdec:prompt_tokens_total",
    ):
        assert name in m, name
    assert m["specdec:spec_decode_num_draft_tokens_total"] > 0
    assert m["specdec:spec_decode_num_accepted_tokens_total"] > 0
    assert any(k.startswith('specdec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') for k in m)

    from specdec.serve.traffic_log import read_traffic

    deadline = time.time() + 10  # the writer thread writes soon after the reply
    while not any(r["prompt"] == PROMPTS[3] for r in list(read_traffic(log_dir))):
        assert time.time() < deadline
        time.sleep(0.05)
    records = list(read_traffic(log_dir))
    chat = [r for r in records if r["meta"]["chat"]]
    assert chat and chat[0]["prompt"][0]["role"] == "user"


# ---- back-pressure --------------------------------------------------------------------------


def test_full_queue_gets_429_with_retry_after(model_dir):
    """Capacity 2 (one decoding, one waiting): of 12 simultaneous long requests, the ones
    that find it full get 429 with Retry-After, the others are served."""
    srv = ServerProcess(model_dir, "--max-batch", "1", "--max-queue", "1")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        barrier = threading.Barrier(12)

        def call(_):
            barrier.wait()
            try:
                client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=100, temperature=0)
                return None
            except openai.RateLimitError as e:
                return e.response

        with ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(call, range(12)))
        refused = [r for r in outcomes if r is not None]
        assert refused and len(refused) < 12
        for r in refused:
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert assert_error_shape(r.json(), 429)["type"] == "rate_limit_error"
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        srv.close()


@pytest.mark.slow
def test_real_model_serves_lossless_chat(tmp_path):
    """SmolLM2-135M: streamed equals not streamed, and the ngram drafter changes nothing."""
    srv = ServerProcess("smollm2-135m", "--served-model-name", "smol", backend="auto")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "List three colors as a JSON array."}]
        base = dict(model="smol", messages=messages, max_tokens=24, temperature=0)
        plain = client.chat.completions.create(**base, extra_body={"drafter": "none"})
        spec = client.chat.completions.create(**base, extra_body={"drafter": "ngram"})
        assert plain.choices[0].message.content == spec.choices[0].message.content
        assert plain.choices[0].message.content.strip()
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**base, stream=True))
        assert streamed == spec.choices[0].message.content
    finally:
        srv.close()


def test_decoded_prefix_cache_serves_a_conversation_from_its_cache(model_dir):
    """--prefix-cache decoded: a conversation's second turn finds its first prompt and answer
    cached, not cut to a 128-token chunk (prompt-only caching keeps nothing of prompts this short)."""
    srv = ServerProcess(model_dir, "--backend", "native", "--prefix-cache", "decoded", "--max-batch", "1")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": PROMPTS[2]}]
        first = client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": PROMPTS[1]}]
        second = client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0)
        assert second.usage.prompt_tokens > first.usage.prompt_tokens
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    finally:
        srv.close()
