"""The gateway under shared use (issue 16), through a real server process: tenants from an
API key file (and cache_salt) share no learned state, `spec_decode` is opt-in, text that is
not valid Unicode is a 400 naming its field, request ids, CORS, JSON access logs, /version,
and metrics labelled with the model name and counted per step."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_llama
from served_helpers import PROMPTS, ServerProcess, assert_error_shape, model_dir  # noqa: F401  (fixture)
from specdec import __version__
from specdec.config import EngineConfig
from specdec.request import Prepared
from specdec.sampling import SamplingParams
from specdec.serve.metrics import ServerMetrics
from specdec.serve.scheduler import GenRequest, Scheduler

MODEL = "tiny"
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
ANON_KEY = "sk-anonymous"  # listed without a tenant name: its tenant is a hash of the key
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):  # noqa: F811
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# key tenant\nsk-alice alice\n\nsk-bob bob\n" + ANON_KEY + "\n")
    srv = ServerProcess(model_dir, "--served-model-name", MODEL, "--api-key-file", str(key_file),
                        "--drafter", "suffix", "--max-batch", "4", "--allowed-origins", ORIGIN)
    yield srv
    srv.close()


def client_for(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def post(server, path: str, body: dict, key: str = "sk-alice", **headers) -> httpx.Response:
    """Posts `body` as JSON with ASCII escapes, so a lone surrogate travels as `\\ud800`
    (httpx's own encoder writes UTF-8, which cannot hold one)."""
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json", **headers}
    return httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=120)


# ---- tenants ----------------------------------------------------------------------------------


def test_keys_from_the_file_authenticate_and_others_do_not(server):
    for key in [*KEYS, ANON_KEY]:
        assert [m.id for m in client_for(server, key).models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        client_for(server, "sk-eve").models.list()


def test_a_tenant_learns_from_its_own_traffic_and_no_other_tenant_does(server):
    """Fault 5: the suffix drafter's process-wide trie is per tenant. Alice's second identical
    request accepts more than her first (she taught it); Bob, after Alice's traffic, and Alice
    under another cache_salt see exactly what a fresh tenant sees: Alice's first statistics."""
    def ask(key: str, **extra):
        reply = client_for(server, key).completions.create(
            model=MODEL, prompt=PROMPTS[3], max_tokens=40, temperature=0,
            extra_body={"k": 4, "return_spec_decode": True, **extra})
        spec = reply.model_extra["spec_decode"]
        return (reply.choices[0].text, (spec["drafted"], spec["accepted"]),
                reply.usage.prompt_tokens_details.cached_tokens)

    alice1 = ask("sk-alice")
    alice2 = ask("sk-alice")
    assert alice2[0] == alice1[0]  # greedy: the same text either way
    assert alice2[1][1] > alice1[1][1], (alice1, alice2)  # her own earlier output is drafted from
    assert ask("sk-bob") == alice1
    assert ask("sk-alice", cache_salt="project-x") == alice1
    assert ask(ANON_KEY) == alice1


def test_spec_decode_is_opt_in(server):
    client = client_for(server, "sk-alice")
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert "spec_decode" not in plain.model_extra
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                            stream=True))
    assert not any("spec_decode" in c.model_extra for c in chunks)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                            stream=True, extra_body={"return_spec_decode": True}))
    assert chunks[-1].model_extra["spec_decode"]["steps"] >= 1


# ---- text that is not valid Unicode ----------------------------------------------------------

LONE = "a\ud800b"
SURROGATE_BODIES = [  # (route, body, the param the 400 names)
    ("chat", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\udfff"},
                           {"role": "user", "content": "x"}]}, "messages[1].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", LONE]}, "stop[1]"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "user": LONE}, "user"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "cache_salt": LONE}, "cache_salt"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "function", "function": {"name": "f", "description": LONE}}]},
     "tools[0].function.description"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}],
              "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {LONE: 1}}}},
     "response_format.json_schema.schema"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "metadata": {"k": LONE}}, "metadata.k"),
    ("completions", {"prompt": LONE}, "prompt"),
    ("completions", {"prompt": [LONE]}, "prompt[0]"),
    ("completions", {"prompt": "hi", "stop": LONE}, "stop"),
    ("completions", {"prompt": "hi", "model": LONE}, "model"),
]


@pytest.mark.parametrize("route,body,param", SURROGATE_BODIES)
def test_a_lone_surrogate_is_a_400_naming_the_field(server, route, body, param):
    """Fault 7: JSON's \\ud800 escape parses to a lone surrogate, which no tokenizer encodes:
    a 400 naming the field, never a 500."""
    r = post(server, "/v1/chat/completions" if route == "chat" else "/v1/completions",
             {"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = assert_error_shape(r.json(), 400)
    assert err["param"] == param and "surrogate" in err["message"], err


def test_an_unknown_field_named_by_a_lone_surrogate_is_a_400(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "\ud800x": 1})
    assert r.status_code == 400 and "surrogate" in assert_error_shape(r.json(), 400)["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                   headers={"Authorization": "Bearer sk-alice", "content-type": "application/json"})
    assert r.status_code == 400 and assert_error_shape(r.json(), 400)  # bytes that are not UTF-8


ANY_TEXT = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=12)  # Cs: lone surrogates
TEXT_FIELDS = {
    "chat": {
        "content": lambda t: {"messages": [{"role": "user", "content": t}]},
        "part": lambda t: {"messages": [{"role": "system", "content": [{"type": "text", "text": t}]},
                                        {"role": "user", "content": "hi"}]},
        "tool_result": lambda t: {"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": json.dumps({"x": t})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": t}]},
        "stop": lambda t: {"messages": [{"role": "user", "content": "hi"}], "stop": [t]},
        "user": lambda t: {"messages": [{"role": "user", "content": "hi"}], "user": t},
        "tool": lambda t: {"messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "function",
             "function": {"name": "f", "description": t, "parameters": {"type": "object"}}}]},
    },
    "completions": {
        "prompt": lambda t: {"prompt": t},
        "prompt_list": lambda t: {"prompt": [t]},
        "stop": lambda t: {"prompt": "hi", "stop": t},
        "cache_salt": lambda t: {"prompt": "hi", "cache_salt": t},
    },
}
FIELD_CASES = [(route, name) for route, fields in TEXT_FIELDS.items() for name in fields]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(FIELD_CASES), text=ANY_TEXT)
def test_fuzzed_text_fields_never_get_a_5xx(server, case, text):
    route, name = case
    body = {**TEXT_FIELDS[route][name](text), "max_tokens": 2}
    r = post(server, "/v1/chat/completions" if route == "chat" else "/v1/completions", body)
    assert r.status_code in (200, 400), (body, r.status_code, r.text)
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


# ---- operations -------------------------------------------------------------------------------


def test_request_ids_version_and_cors(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, **{"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    made = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    # too long: replaced
    refused = post(server, "/v1/completions", {"prompt": "hi"}, **{"X-Request-Id": "x" * 500})
    assert re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])
    assert httpx.get(server.url + "/version").json() == {"version": __version__}

    preflight = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, Origin=ORIGIN)
    assert r.headers["access-control-allow-origin"] == ORIGIN
    # refusals carry it too
    r = post(server, "/v1/completions", {"prompt": "hi"}, key="sk-eve", Origin=ORIGIN)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_json_access_log_has_id_tenant_route_status_latency_tokens(server):
    r = post(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0,
                                         "cache_salt": "s1"}, key="sk-bob", **{"X-Request-Id": "log-me-1"})
    assert r.status_code == 200
    deadline = time.time() + 10
    while not (lines := [ln for ln in server.lines if '"log-me-1"' in ln]):
        assert time.time() < deadline, "no access log line"
        time.sleep(0.05)
    entry = json.loads(lines[0])
    assert (entry["request_id"] == "log-me-1" and entry["route"] == "/v1/completions"
            and entry["status"] == 200)
    assert entry["tenant"].startswith("bob#salt-") and "s1" not in entry["tenant"]  # the salt is hashed
    usage = r.json()["usage"]
    assert ((entry["prompt_tokens"], entry["completion_tokens"])
            == (usage["prompt_tokens"], usage["completion_tokens"]))
    assert entry["latency_s"] > 0


def test_metrics_carry_the_model_name_and_the_new_series(server):
    client = client_for(server, "sk-alice")
    list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True))
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": "Bearer sk-alice"},
                      json={"prompt": PROMPTS[2], "max_tokens": 200, "stream": True}) as r:
        next(r.iter_lines())  # then hang up mid-stream
    deadline = time.time() + 20
    while (m := server.metrics()).get('specdec:num_requests_aborted_total'
                                      '{reason="client_disconnect"}', 0) < 1:
        assert time.time() < deadline, "the disconnect was not counted"
        time.sleep(0.1)
    assert m["specdec:inter_token_latency_seconds_count"] > 0
    assert m["specdec:request_queue_time_seconds_count"] > 0
    assert 0 <= m["specdec:kv_cache_usage_perc"] <= 1
    raw = httpx.get(server.url + "/metrics").text
    assert f'specdec:num_requests_running{{model_name="{MODEL}"}}' in raw


def test_spec_counters_move_every_step_not_only_when_a_request_ends():
    """The spec-decode counters grow while a request runs (vLLM counts per step), and add
    up to the request's own statistics when it ends (nothing counted twice)."""
    target = tiny_llama(0)
    metrics = ServerMetrics("tiny")
    sched = Scheduler(target, EngineConfig(drafter="ngram:min=1", k=3), max_batch=2, metrics=metrics)
    events: list[tuple[str, object]] = []
    ids = target.tokenizer.encode(PROMPTS[0])
    sched.submit(GenRequest(Prepared.tokens(ids, SamplingParams(), 60),
                            lambda kind, payload: events.append((kind, payload))))

    def value(name: str) -> float:
        return metrics.registry.get_sample_value("specdec:" + name, {"model_name": "tiny"}) or 0.0

    while_running = []
    for _ in range(500):
        sched.step()
        if any(kind == "done" for kind, _ in events):
            break
        while_running.append(value("spec_decode_num_draft_tokens_total"))
    stats = next(p for kind, p in events if kind == "done").stats
    assert stats.num_accepted_tokens > 0, "nothing accepted: the test would pass vacuously"
    assert max(while_running) > 0  # counted before the request ended
    assert value("spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value("spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    assert value("inter_token_latency_seconds_count") >= 1
