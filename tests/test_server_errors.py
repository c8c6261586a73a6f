"""The real server under bad input and load: malformed or out-of-range requests get OpenAI-shaped
400s (413, 404 for size and route), fuzzed bodies never get a 5xx, 32 concurrent clients (some
of which disconnect) get the single-request greedy output while disconnected requests never
finish (their cache slots were freed), and a full queue answers 429 with Retry-After. The
module starts its own server like test_server's (see served_helpers) and, for back-pressure, a
second one with a one-request capacity.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from served_helpers import (  # noqa: F401  (fixtures)
    JSON,
    KEY,
    MODEL,
    PROMPTS,
    ServerProcess,
    assert_error_shape,
    client,
    http,
    log_dir,
    model_dir,
    server,
)

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
def test_bad_requests_get_openai_shaped_400s(http, route, body, param):  # noqa: F811  (fixtures)
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


def test_openai_client_sees_bad_request_and_size_limits(server, client, http):  # noqa: F811  (fixtures)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=3)
    assert info.value.body["param"] == "temperature"
    r = http.post("/v1/completions", content=b"x" * (9 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and assert_error_shape(r.json(), 413)
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and assert_error_shape(r.json(), 404)


MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bad"]) | JSON},
    optional={"content": st.text(max_size=40) | JSON
              | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
                         max_size=2)},
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
def test_fuzzed_bodies_never_get_a_5xx(http, chat, chat_body, completion_body):  # noqa: F811  (fixtures)
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


def test_32_concurrent_clients_with_disconnects(server, http):  # noqa: F811  (fixtures)
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
                with c.stream("POST", "/v1/completions",
                              json={**body, "max_tokens": 200, "stream": True}) as r:
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
        v for k, v in before.items() if k.startswith("specdec:num_requests_aborted_total"))
    # every request ends once, as a success or an abort (a dropped one may have finished first)
    assert done + aborted == len(plans) and aborted <= sum(mode.startswith("drop") for mode, _ in results)
    assert done >= completed + sum(mode == "finished_anyway" for mode, _ in results)
    assert m['specdec:batch_size_bucket{le="1.0"}'] < m["specdec:batch_size_count"]  # batched steps
    assert httpx.get(server.url + "/health").status_code == 200



# ---- back-pressure --------------------------------------------------------------------------


def test_full_queue_gets_429_with_retry_after(model_dir):  # noqa: F811  (fixtures)
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
