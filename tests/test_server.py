"""The OpenAI gateway as a real server process on 127.0.0.1, driven by the official client:
health, models and the API key, chat and completions against the target, seeds, extra_body,
metrics and the traffic log, and the decoded prefix cache. One server (tiny random model, API
key, traffic log; see served_helpers) serves most tests; bad requests, fuzzed bodies, load and
back-pressure are in test_server_errors.
"""

from __future__ import annotations

import os
import re
import time

import httpx
import openai
import pytest

from conftest import save_loaded, tiny_llama
from served_helpers import (  # noqa: F401  (fixtures)
    KEY,
    MODEL,
    PROMPTS,
    ServerProcess,
    assert_error_shape,
    client,
    log_dir,
    model_dir,
    server,
)

# ---- basics ---------------------------------------------------------------------------------


def test_health_is_503_while_loading_then_200(server):  # noqa: F811  (fixtures)
    loading = [body for status, body in server.health if status == 503]
    assert loading, server.health
    assert loading[0]["error"]["message"] == "Loading model"
    assert loading[0]["error"]["type"] == "unavailable_error"
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_models_and_api_key(server, client):  # noqa: F811  (fixtures)
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


def test_chat_streamed_equals_not_streamed(client):  # noqa: F811  (fixtures)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                          extra_body={"return_spec_decode": True})
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens == 20 or full.choices[0].finish_reason == "stop"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    spec = full.model_extra["spec_decode"]
    assert spec["steps"] >= 1 and set(spec) >= {"drafted", "accepted", "acceptance_rate",
                                                 "mean_accepted_length"}

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


def test_completions_equal_the_target_and_stop_strings(model_dir, client):  # noqa: F811  (fixtures)
    from specdec.engine import Engine
    from specdec.models import load_model

    plain = Engine(load_model(model_dir), drafter="none", k=0)
    want = plain.generate(PROMPTS[1], max_new_tokens=24, chat=False)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)

    # A stop string that first appears at position i cuts the text there, streamed or not.
    text = want.text
    i = next(i for i in range(3, len(text) - 2)
             if text.find(text[i : i + 2]) == i and "\ufffd" not in text[i : i + 2])
    stop = text[i : i + 2]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                    stop=[stop, "zzzz"])
    assert cut.choices[0].text == text[:i] and cut.choices[0].finish_reason == "stop"
    pieces = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == text[:i]


def test_seed_makes_sampling_reproducible(client):  # noqa: F811  (fixtures)
    def sample(seed):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0,
                                      seed=seed)
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_extra_body_drafter_and_k(client):  # noqa: F811  (fixtures)
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



def test_metrics_and_traffic_log(server, client, log_dir):  # noqa: F811  (fixtures)
    client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0)
    m = server.metrics()
    for name in (
        "specdec:spec_decode_num_drafts_total", "specdec:spec_decode_num_draft_tokens_total",
        "specdec:spec_decode_num_accepted_tokens_total", "specdec:e2e_request_latency_seconds_count",
        "specdec:time_to_first_token_seconds_count", "specdec:num_requests_waiting",
        "specdec:num_requests_running", "specdec:generation_tokens_total", "specdec:prompt_tokens_total",
    ):
        assert name in m, name
    assert m["specdec:spec_decode_num_draft_tokens_total"] > 0
    assert m["specdec:spec_decode_num_accepted_tokens_total"] > 0
    assert any(k.startswith('specdec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') for k in m)

    from specdec.traffic_log import read_traffic

    deadline = time.time() + 10  # the writer thread writes soon after the reply
    while not any(r["prompt"] == PROMPTS[3] for r in list(read_traffic(log_dir))):
        assert time.time() < deadline
        time.sleep(0.05)
    records = list(read_traffic(log_dir))
    chat = [r for r in records if r["meta"]["chat"]]
    assert chat and chat[0]["prompt"][0]["role"] == "user"



@pytest.mark.slow
def test_real_model_serves_lossless_chat(tmp_path):
    """SmolLM2-135M: streamed equals not streamed, the ngram drafter changes nothing, and a
    conversation's next turn reuses the answer bit-exactly."""
    srv = ServerProcess("smollm2-135m", "--served-model-name", "smol", backend="auto")
    try:
        slots, _, limit = _stated_kv_memory(srv.lines)  # 16 windows of 8192 tokens: 2.8 GiB, if all full
        if os.path.exists("/proc/self/statm"):
            assert slots == 16 and _resident(srv.proc.pid) < min(1.5 * 1024**3, limit / 2)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "List three colors as a JSON array."}]
        base = dict(model="smol", messages=messages, max_tokens=24, temperature=0)
        plain = client.chat.completions.create(**base, extra_body={"drafter": "none"})
        spec = client.chat.completions.create(**base, extra_body={"drafter": "ngram"})
        assert plain.choices[0].message.content == spec.choices[0].message.content
        assert plain.choices[0].message.content.strip()
        streamed = "".join(c.choices[0].delta.content or ""
                           for c in client.chat.completions.create(**base, stream=True))
        assert streamed == spec.choices[0].message.content
        # the next turn: the default cache keeps turn 1's answer too (prompts run as decode
        # steps, prefix_cache.py), and the reply is a cold start's (another salt reuses nothing)
        answer = {"role": "assistant", "content": plain.choices[0].message.content}
        turn2 = {**base, "messages": [*messages, answer, {"role": "user", "content": "Now three more."}]}
        warm = client.chat.completions.create(**turn2, extra_body={"drafter": "ngram"})
        cold = client.chat.completions.create(**turn2, extra_body={"drafter": "none", "cache_salt": "cold"})
        assert warm.usage.prompt_tokens_details.cached_tokens > plain.usage.prompt_tokens
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert warm.choices[0].message.content == cold.choices[0].message.content
    finally:
        srv.close()


def test_decoded_prefix_cache_serves_a_conversation_from_its_cache(model_dir):  # noqa: F811  (fixtures)
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



def _resident(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _stated_kv_memory(lines: list[str]) -> tuple[int, float, float]:
    """(slots, bytes a token, the most in bytes) from the server's ready line, which states the
    default cache of quantized weights on a CPU: bf16."""
    line = next(x for x in lines if "specdec serve: ready" in x)
    stated = re.search(r"KV cache: (\d+) slots x \d+ tokens, bfloat16, ([\d.]+) KiB a token; committed as "
                       r"tokens are held, at most ([\d.]+) GiB", line)
    assert stated, line
    return int(stated.group(1)), float(stated.group(2)) * 1024, float(stated.group(3)) * 1024**3


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_prompts_up_to_the_models_window_are_served_in_memory_that_grows_with_them(tmp_path):
    """A model with an 8192-token window takes a 4,400-token prompt by default (the old default
    window stopped at 4096), and the server's memory grows by what the prompt holds, within
    what its start-up line states for its 16 slots."""
    long_window = save_loaded(tiny_llama(0, layers=16, hidden=256, max_positions=8192), tmp_path / "long")
    srv = ServerProcess(long_window, "--served-model-name", "long", backend="native")
    try:
        slots, per_token, limit = _stated_kv_memory(srv.lines)
        assert slots == 16 and limit >= 0.99 * 16 * 8192 * per_token  # as rounded in the line
        started = _resident(srv.proc.pid)
        assert started < limit  # 16 windows of 8192 tokens: 1 GiB, which a committed cache would add
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        words = [w for line in PROMPTS for w in line.split()]
        prompt = " ".join(words[i % len(words)] for i in range(2650))  # ~4,400 tokens
        reply = client.completions.create(model="long", prompt=prompt, max_tokens=4, temperature=0)
        held = reply.usage.prompt_tokens + 4
        assert 4096 < held <= 8192
        grown = _resident(srv.proc.pid) - started
        assert grown < held * per_token + 256 * 1024**2  # the prompt's cache, and the prefill's scratch
    finally:
        srv.close()
