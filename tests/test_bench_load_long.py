"""The load benchmark's long agent sessions, raw prompts, llama-server peer and rounds: the pure
parts table by table, and (slow) one real llama-server where the binary is built."""

from __future__ import annotations

import asyncio
import json
import random
from argparse import Namespace
from pathlib import Path

import httpx
import pytest

from specdec.bench import llama_server
from specdec.bench import load as loadbench
from specdec.bench.agent_corpus import POLICY_SECTIONS, TOOL_SCHEMAS, system_prompt
from specdec.bench.load_rounds import (
    Target,
    first_turn_agreement,
    fresh_turns,
    mark_exact_matches,
    median,
    schedule,
    summarize,
    variant,
)
from specdec.bench.long_sessions import RESULT_TOKENS, Session, make_long_sessions, split_budget
from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest
from specdec.tools import render_chat


def rough_count(text: str) -> int:
    """A tokenizer-free stand-in: about four characters a token."""
    return len(text) // 4


@pytest.fixture(scope="module")
def tokenizer():
    from specdec.errors import SpecdecError
    from specdec.models import load_tokenizer

    try:
        return load_tokenizer("smollm2-135m")
    except SpecdecError as e:
        pytest.skip(str(e))


def token_count(tokenizer):
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def walk(session: Session, reply: str) -> list[list[dict]]:
    """The messages of every turn's request, with `reply` as each live answer."""
    prompts, messages = [], list(session.opening)
    for added in session.turns:
        messages = [*messages, *added]
        prompts.append(messages)
        messages = [*messages, {"role": "assistant", "content": reply}]
    return prompts


# ---- the session generator ----------------------------------------------------------------------

@pytest.mark.parametrize("n, turns", [(1, 1), (3, 2), (4, 4), (2, 6)])
def test_sessions_are_deterministic_and_seeded(n, turns):
    first = make_long_sessions(n, turns, rough_count, seed=7)
    assert first == make_long_sessions(n, turns, rough_count, seed=7)
    assert first != make_long_sessions(n, turns, rough_count, seed=8)
    assert len(first) == n and all(len(s.turns) == turns for s in first)


@pytest.mark.parametrize("turns", [1, 3, 6])
def test_sessions_share_only_the_system_prompt(turns):
    sessions = make_long_sessions(5, turns, rough_count)
    systems = {s.opening[0]["content"] for s in sessions}
    assert systems == {system_prompt()}
    generated = [[*s.opening[1:], *(m for added in s.turns for m in added)] for s in sessions]
    contents = [{json.dumps(m, sort_keys=True) for m in messages} for messages in generated]
    for i, mine in enumerate(contents):
        for theirs in contents[i + 1:]:
            assert not mine & theirs


def test_policy_and_tool_schemas_have_the_planned_size(tokenizer):
    count = token_count(tokenizer)
    policy = "\n".join(rule for rules in POLICY_SECTIONS.values() for rule in rules)
    assert 1000 <= count(policy) <= 2000
    assert len(TOOL_SCHEMAS) >= 10
    assert all(t["function"]["parameters"]["type"] == "object" for t in TOOL_SCHEMAS)


@pytest.mark.parametrize("turns, max_tokens", [(1, 128), (3, 128), (5, 64), (6, 128)])
def test_conversations_grow_to_4_6k_tokens_with_results_of_100_1500(tokenizer, turns, max_tokens):
    count = token_count(tokenizer)
    sessions = make_long_sessions(4, turns, count, reply_tokens=max_tokens)
    reply = " ok" * max_tokens  # " ok" is one token: every reply at its allowance
    for session in sessions:
        prompts = walk(session, reply)
        sizes = [len(tokenizer.encode(render_chat(tokenizer, p), add_special_tokens=False)) for p in prompts]
        assert 4000 <= sizes[-1] <= 6000, sizes
        assert sizes == sorted(sizes)
        results = [m["content"] for m in prompts[-1] if m["role"] == "tool"]
        assert results and all(100 <= count(r) <= 1500 for r in results)
        assert all(json.loads(r)["status"] for r in results)  # JSON, as a tool returns it


def test_too_many_turns_are_refused():
    with pytest.raises(ValueError, match="turns do not fit"):
        make_long_sessions(1, 40, rough_count)


@pytest.mark.parametrize("budget, parts", [(150, 1), (1400, 1), (3000, 3), (2000, 9), (7000, 5)])
def test_split_budget_fills_the_budget_within_the_result_range(budget, parts):
    sizes = split_budget(random.Random(0), budget, parts)
    assert sum(sizes) == budget and len(sizes) == parts
    assert all(RESULT_TOKENS[0] <= s <= RESULT_TOKENS[1] for s in sizes)


# ---- the request bodies -------------------------------------------------------------------------

def bench_args(**overrides) -> Namespace:
    args = loadbench._parser().parse_args([])
    return Namespace(**{**vars(args), **overrides})


SPECDEC_ON = Target("specdec", "on", "specdec spec", "http://s", {"return_spec_decode": True})
SPECDEC_OFF = Target("specdec", "off", "specdec plain", "http://s",
                     {"return_spec_decode": True, "drafter": "none"})
LLAMA_ON = Target("llama-server", "on", "llama-server ngram-mod", "http://l")


@pytest.mark.parametrize("target, raw, route, ignore_eos", [
    (SPECDEC_ON, True, "/v1/completions", False), (SPECDEC_OFF, True, "/v1/completions", True),
    (LLAMA_ON, True, "/v1/completions", True), (SPECDEC_OFF, False, "/v1/chat/completions", False),
    (LLAMA_ON, False, "/v1/chat/completions", False), (SPECDEC_ON, False, "/v1/chat/completions", True),
])
def test_request_bodies(target, raw, route, ignore_eos):
    session = make_long_sessions(1, 2, rough_count)[0]
    messages = walk(session, "reply")[1]
    args = bench_args(raw_prompt=raw, ignore_eos=ignore_eos)
    got_route, body = loadbench.request_body(target, messages, args, lambda m: "TEXT")
    assert got_route == route
    assert body["temperature"] == 0.0 and body["max_tokens"] == 128 and body["stream"] is True
    assert body.get("ignore_eos", False) is ignore_eos  # llama-server takes it too
    assert (body.get("prompt"), body.get("messages")) == (("TEXT", None) if raw else (None, messages))
    specdec_fields = {"drafter", "return_spec_decode"} & set(body)
    assert specdec_fields == (set(target.extra) if target.engine == "specdec" else set())
    if target.engine == "specdec":  # specdec refuses unknown fields by name; these all pass
        (CompletionRequest if raw else ChatCompletionRequest).model_validate(body)


def test_raw_prompt_is_specdecs_own_chat_rendering(tokenizer):
    session = make_long_sessions(1, 2, token_count(tokenizer))[0]
    messages = walk(session, "Let me check that for you.")[1]
    render = loadbench._renderer(bench_args(raw_prompt=True), Namespace(tokenizer=tokenizer))
    text = render(messages)
    assert text == render_chat(tokenizer, messages)
    assert text.startswith("<|im_start|>system\n# Support policy")
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<tool_response>") == sum(m["role"] == "tool" for m in messages)
    assert "Let me check that for you.<|im_end|>" in text


# ---- llama-server's command line ----------------------------------------------------------------

@pytest.mark.parametrize("slots, window, spec, webui, tail", [
    (4, 8192, None, True, ["--parallel", "4", "-c", "32768", "--no-webui"]),
    (2, 8192, "ngram-mod", True,
     ["--parallel", "2", "-c", "16384", "--no-webui", "--spec-type", "ngram-mod"]),
    (1, 2048, "ngram-mod", False, ["--parallel", "1", "-c", "2048", "--spec-type", "ngram-mod"]),
])
def test_llama_server_flags(slots, window, spec, webui, tail):
    config = llama_server.LlamaServerConfig(Path("/bin/ls"), Path("/m.gguf"), window, threads=2,
                                            slots=slots, spec_type=spec, no_webui=webui)
    assert llama_server.server_flags(config, 8123) == [
        "/bin/ls", "-m", "/m.gguf", "--host", "127.0.0.1", "--port", "8123", "-t", "2", *tail]


HELP = """-t,    --threads N                      number of CPU threads
--ui, --webui, --no-ui, --no-webui     whether to enable the Web UI
--spec-type [none|ngram-cache|ngram-simple|ngram-map-k|ngram-map-k4v|ngram-mod]
"""


@pytest.mark.parametrize("flag, present", [("--no-webui", True), ("--spec-type", True), ("--threads", True),
                                           ("--webui-config", False), ("--spec", False), ("-c", False)])
def test_has_flag_reads_the_help(flag, present):
    assert llama_server.has_flag(HELP, flag) is present


def test_context_window_is_the_files_own(tokenizer):
    from specdec.models import builtin_gguf_path

    assert llama_server.context_window(builtin_gguf_path("smollm2-135m")) == 8192


# ---- rounds, medians and counts -----------------------------------------------------------------

def test_schedule_interleaves_the_engines_within_each_round():
    a, b = Target("specdec", "off", "A", "u"), Target("llama-server", "off", "B", "v")
    order = [(r, t.label, c) for r, t, c in schedule([a, b], [1, 4], rounds=2)]
    assert order == [(1, "A", 1), (1, "A", 4), (1, "B", 1), (1, "B", 4),
                     (2, "A", 1), (2, "A", 4), (2, "B", 1), (2, "B", 4)]


@pytest.mark.parametrize("values, expected", [([3.0], 3.0), ([5.0, 1.0, 3.0], 3.0), ([1.0, 2.0], 1.5),
                                              ([None, 2.0], 2.0), ([None], None)])
def test_median(values, expected):
    assert median(values) == expected


def run(label, engine, c, round_, tok_per_s, p95, texts, errors=0, lost=0):
    return {"label": label, "engine": engine, "concurrency": c, "speculation": "spec" in label,
            "round": round_, "tok_per_s": tok_per_s, "latency_p95_s": p95, "texts": texts,
            "requests": len(texts), "tokens": 10 * len(texts), "errors": errors, "lost": lost,
            "tau": None, "first_error": "HTTP 500" if errors else None}


def test_summarize_takes_medians_and_sums_counts_in_first_run_order():
    texts = {"0.0": "a", "1.0": "b"}
    runs = [run("specdec spec", "specdec", 1, 1, 10.0, 2.0, texts),
            run("specdec spec", "specdec", 2, 1, 30.0, 4.0, texts),
            run("specdec spec", "specdec", 1, 2, 14.0, 1.0, texts),
            run("specdec spec", "specdec", 2, 2, 20.0, 5.0, {"0.0": "a"}, errors=1),
            run("specdec spec", "specdec", 1, 3, 12.0, 3.0, texts),
            run("specdec spec", "specdec", 2, 3, 25.0, 6.0, texts, lost=2)]
    rows = summarize(runs)
    assert [(r["label"], r["concurrency"]) for r in rows] == [("specdec spec", 1), ("specdec spec", 2)]
    assert [(r["tok_per_s"], r["latency_p95_s"], r["rounds"]) for r in rows] == [(12.0, 2.0, 3),
                                                                                (25.0, 5.0, 3)]
    assert rows[1]["tok_per_s_rounds"] == [30.0, 20.0, 25.0]
    assert [(r["requests"], r["errors"], r["lost"]) for r in rows] == [(6, 0, 0), (5, 1, 2)]
    assert rows[1]["first_error"] == "HTTP 500" and rows[1]["tau"] is None
    mark_exact_matches(rows)  # each row is the first at its concurrency: its own reference
    assert [r["exact_match"] for r in rows] == ["6/6", "5/5"]


def test_exact_matches_and_first_turns_compare_the_right_rows():
    rows = summarize([run("specdec spec", "specdec", 1, 1, 1.0, 1.0, {"0.0": "a", "0.1": "b", "1.0": "c"}),
                      run("specdec plain", "specdec", 1, 1, 1.0, 1.0, {"0.0": "a", "0.1": "b", "1.0": "c"}),
                      run("llama-server plain", "llama-server", 1, 1, 1.0, 1.0,
                          {"0.0": "a", "0.1": "x", "1.0": "y"}),
                      run("llama-server ngram-mod", "llama-server", 1, 1, 1.0, 1.0,
                          {"0.0": "a", "0.1": "x", "1.0": "z"})])
    assert first_turn_agreement(rows) == {"llama-server plain": "1/2", "llama-server ngram-mod": "1/2"}
    mark_exact_matches(rows)  # each engine against its own first row
    assert [r["exact_match"] for r in rows] == ["3/3", "3/3", "3/3", "2/3"]


def test_exact_matches_compare_rows_of_the_same_round_and_concurrency():
    # round 2 and concurrency 2 got other prompts, so other replies: only like is compared with like
    runs = [run("specdec plain", "specdec", 1, 1, 1.0, 1.0, {"0.0": "a"}),
            run("specdec plain", "specdec", 2, 1, 1.0, 1.0, {"0.0": "b"}),
            run("specdec spec", "specdec", 1, 1, 1.0, 1.0, {"0.0": "a"}),
            run("specdec spec", "specdec", 2, 1, 1.0, 1.0, {"0.0": "b"}),
            run("specdec plain", "specdec", 1, 2, 1.0, 1.0, {"0.0": "c"}),
            run("specdec plain", "specdec", 2, 2, 1.0, 1.0, {"0.0": "d"}),
            run("specdec spec", "specdec", 1, 2, 1.0, 1.0, {"0.0": "c"}),
            run("specdec spec", "specdec", 2, 2, 1.0, 1.0, {"0.0": "x"})]
    rows = summarize(runs)
    mark_exact_matches(rows)
    assert [(r["label"], r["concurrency"], r["exact_match"]) for r in rows] == [
        ("specdec plain", 1, "2/2"), ("specdec plain", 2, "2/2"),
        ("specdec spec", 1, "2/2"), ("specdec spec", 2, "1/2")]


def test_every_configuration_gets_fresh_turns():
    levels = [1, 2, 4]
    tags = {variant(r, c, levels) for r in (1, 2, 3) for c in levels}
    assert len(tags) == 9 and 0 not in tags  # one per (round, concurrency), none the warm-up's
    sessions = [Session([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                        [[{"role": "tool", "content": "{}"}, {"role": "user", "content": "q"}],
                         [{"role": "user", "content": "more"}]])]
    assert fresh_turns(sessions, 0) is sessions
    tagged = fresh_turns(sessions, 7)[0]
    assert tagged.opening == sessions[0].opening  # the warm part stays shared
    assert tagged.turns[0][0]["content"] == "(ref 007) {}" and tagged.turns[0][1:] == sessions[0].turns[0][1:]
    assert tagged.turns[1:] == sessions[0].turns[1:]
    assert sessions[0].turns[0][0]["content"] == "{}"  # the caller's sessions are not changed


@pytest.mark.parametrize("outcomes, expected", [
    # per turn of session 0 and session 1: "ok", "error" (raises) or "cut" (a stream that stops short)
    ({}, (6, 0, 0)),
    ({(0, 0): "error"}, (3, 1, 2)),
    ({(0, 1): "cut"}, (4, 0, 2)),
    ({(0, 2): "error", (1, 0): "cut"}, (2, 1, 3)),
])
def test_errors_and_lost_replies_are_counted(monkeypatch, outcomes, expected):
    async def fake_request(client, url, route, body, headers):
        session = int(body["messages"][1]["content"].split()[-1])
        turn = sum(m["role"] == "user" for m in body["messages"]) - 1
        outcome = outcomes.get((session, turn), "ok")
        if outcome == "error":
            raise RuntimeError("HTTP 500: boom")
        return {"latency": 0.1, "ttft": 0.05, "text": f"r{turn}", "spec": {}, "tokens": 3,
                "prompt_tokens": 9, "complete": outcome == "ok"}

    monkeypatch.setattr(loadbench, "one_request", fake_request)
    sessions = [Session([{"role": "system", "content": "s"}, {"role": "user", "content": f"session {i}"}],
                        [[], [{"role": "user", "content": "more"}], [{"role": "user", "content": "again"}]])
                for i in range(2)]
    target = Target("llama-server", "off", "llama-server plain", "http://x")
    result = asyncio.run(loadbench.run_config(target, sessions, 2, bench_args()))
    assert (result["requests"], result["errors"], result["lost"]) == expected
    assert sum(expected) == 6  # every expected reply is a reply, an error or lost


def sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


LLAMA_STREAM = sse({"choices": [{"text": "Hel", "finish_reason": None}]},
                   {"choices": [{"text": "lo", "finish_reason": "length"}],
                    "usage": {"completion_tokens": 2, "prompt_tokens": 5},
                    "timings": {"draft_n": 4, "draft_n_accepted": 3, "prompt_n": 4}}, "[DONE]")
SPECDEC_STREAM = sse({"choices": [{"text": "Hi", "finish_reason": None}]},
                     {"choices": [{"text": "", "finish_reason": "stop"}],
                      "spec_decode": {"drafted": 2, "accepted": 1}},
                     {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 5,
                                               "prompt_tokens_details": {"cached_tokens": 3}}}, "[DONE]")


@pytest.mark.parametrize("stream, text, tokens, spec, prefilled, complete", [
    (LLAMA_STREAM, "Hello", 2, {"drafted": 4, "accepted": 3}, 4, True),
    (SPECDEC_STREAM, "Hi", 1, {"drafted": 2, "accepted": 1}, 2, True),
    (LLAMA_STREAM[: LLAMA_STREAM.index(b"data: [DONE]")], "Hello", 2, {"drafted": 4, "accepted": 3}, 4,
     False),
    (sse({"choices": [{"text": "Hel", "finish_reason": None}]}), "Hel", 0, {}, 0, False),
])
def test_one_request_reads_both_engines_streams(stream, text, tokens, spec, prefilled, complete):
    """Text, completion tokens, draft counts and the prompt tokens each engine ran (not cached)."""
    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream))
        async with httpx.AsyncClient(transport=transport) as client:
            return await loadbench.one_request(client, "http://x", "/v1/completions", {}, {})

    got = asyncio.run(go())
    assert (got["text"], got["tokens"], got["spec"], got["complete"]) == (text, tokens, spec, complete)
    assert got["prefilled"] == prefilled


# ---- a real llama-server ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(not llama_server.DEFAULT_BINARY.exists(),
                    reason="llama-server is not built: python scripts/bench/peers/build_llama_server.py")
def test_llama_server_answers_a_raw_prompt(tokenizer):
    from specdec.models import builtin_gguf_path

    gguf = builtin_gguf_path("smollm2-135m")
    no_webui = llama_server.check_binary(llama_server.DEFAULT_BINARY, llama_server.SPEC_TYPE)
    config = llama_server.LlamaServerConfig(llama_server.DEFAULT_BINARY, gguf, 2048, slots=1,
                                            spec_type=llama_server.SPEC_TYPE, no_webui=no_webui)
    proc, url = llama_server.start(config)
    try:
        loadbench.wait_ready(url, proc, timeout=120)
        prompt = render_chat(tokenizer, [{"role": "user", "content": "Say hello."}])
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    finally:
        llama_server.stop(proc)
    assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert reply["usage"]["completion_tokens"] >= 1 and proc.returncode is not None


def test_server_time_split_reads_the_counters_growth():
    from specdec.bench.server_time import split

    before = {"model_busy_seconds_total:prefill": 5.0, "model_busy_seconds_total:decode": 1.0,
              "batch_size_count": 10, "batch_size_sum": 10, "batch_scored_tokens_total": 10,
              "kv_cache_read_bytes_total": 0.0, "decode_attention_seconds_total": 0.0}
    after = {"model_busy_seconds_total:prefill": 11.0, "model_busy_seconds_total:decode": 5.0,
             "batch_size_count": 30, "batch_size_sum": 70, "batch_scored_tokens_total": 130,
             "kv_cache_read_bytes_total": 4e9, "decode_attention_seconds_total": 3.0}
    assert split(before, after, wall_s=12.5) == {
        "busy_share": 0.8, "prefill_share": 0.6, "seqs_per_step": 3.0, "rows_per_step": 6.0,
        "kv_mb_per_step": 200.0, "attention_share": 0.75}
    assert split(None, None, wall_s=1.0) == {}  # a peer has no such counters
