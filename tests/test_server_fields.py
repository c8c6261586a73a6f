"""Request fields through the real server and the official client: every field the server does
not honour is a 400 naming it (never silently ignored), logprobs are served in OpenAI's shapes
and equal under speculation, and grammar-forced tokens are counted apart from drafts."""

from __future__ import annotations

import openai
import pytest
import torch

from served_helpers import KEY, MODEL, PROMPTS, ServerProcess, log_dir, model_dir  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    srv = ServerProcess(model_dir, "--served-model-name", MODEL, "--api-key-env", "SPECDEC_TEST_KEY",
                        "--drafter", "ngram:min=1", "--max-batch", "4", env={"SPECDEC_TEST_KEY": KEY})
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


USER = {"role": "user", "content": "hi"}
CHAT_REFUSED = [  # (extra_body, param); messages replace the default ones
    ({"logit_bias": {"10": 5}}, "logit_bias"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"stop_token_ids": [2]}, "stop_token_ids"),
    ({"min_p": 0.1}, "min_p"),
    ({"min_tokens": 4}, "min_tokens"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1.0}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"best_of": 2}, "best_of"),
    ({"echo": True}, "echo"),
    ({"store": True}, "store"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs=true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"totally_unknown": 1}, "totally_unknown"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"messages": [{**USER, "foo": 1}]}, "messages[0].foo"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]},
     "messages[0].content[0].cache_control"),
    ({"messages": [{"role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": [USER, {"role": "assistant", "content": "x", "refusal": "no"}, USER]},
     "messages[1].refusal"),
    ({"messages": [{**USER, "name": "alice"}]}, "messages[0].name"),
    ({"messages": [USER, {"role": "assistant", "content": "x", "audio": {"id": "a"}}, USER]},
     "messages[1].audio"),
]
COMPLETION_REFUSED = [
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"logit_bias": {"3": -100}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"n": 3}, "n"),
    ({"messages": [USER]}, "messages"),
]


def _refused(client, route: str, extra: dict) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            messages = extra.pop("messages", [USER])
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
    return info.value


@pytest.mark.parametrize(("route", "extra", "param"), [("chat", e, p) for e, p in CHAT_REFUSED]
                         + [("completions", e, p) for e, p in COMPLETION_REFUSED])
def test_fields_not_honoured_are_refused_by_name(client, route, extra, param):
    error = _refused(client, route, dict(extra))
    assert error.status_code == 400
    body = error.body
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["code"] == 400
    assert param in body["message"], body["message"]
    if param.endswith(("foo", "totally_unknown", "cache_control")):
        assert body["message"] == f"Unrecognized request argument supplied: {param}"
    elif param in ("repetition_penalty", "stop_token_ids", "min_p", "modalities", "prediction", "echo"):
        assert body["message"].startswith(f"{param} is not supported")
    after = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)  # the server still serves
    assert after.choices[0].finish_reason in ("length", "stop")


def test_harmless_values_and_metadata_are_accepted(client):
    """Defaults clients send (n=1, zero penalties, an empty logit_bias, store=false), metadata
    and routing hints (no effect on the output), an assistant message echoed back from a
    response with its empty fields, and the server's own extensions."""
    messages = [USER, {"role": "assistant", "content": "hello", "refusal": None, "audio": None,
                       "function_call": None, "annotations": []}, USER]
    base = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**base)
    extras = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "store": False,
              "user": "u-1", "safety_identifier": "s-1", "metadata": {"run": "7"}, "prompt_cache_key": "p",
              "top_k": 0, "drafter": "ngram", "k": 3, "best_of": None}
    got = client.chat.completions.create(**base,
                                         extra_body={k: v for k, v in extras.items() if k != "best_of"})
    assert got.choices[0].message.content == plain.choices[0].message.content
    assert got.choices[0].logprobs is None
    done = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="u",
                                     extra_body={"best_of": 1})
    assert done.choices[0].logprobs is None


def test_ignore_eos_is_taken_and_alike_under_speculation(client):
    """vLLM's ignore_eos reaches the request (test_engine.py shows a reply running past its EOS):
    every reply runs to max_tokens, the same with and without speculation."""
    base = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=40, temperature=0)
    runs = {drafter: client.chat.completions.create(**base, extra_body={
        "ignore_eos": True, "drafter": drafter, "return_spec_decode": True})
        for drafter in ("none", "ngram:min=1")}
    for got in runs.values():
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 40
    assert runs["ngram:min=1"].choices[0].message.content == runs["none"].choices[0].message.content
    assert runs["ngram:min=1"].model_extra["spec_decode"]["accepted"] > 0, "nothing accepted"
    done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 12 and done.choices[0].finish_reason == "length"


# ---- logprobs -----------------------------------------------------------------------------


def _chat(client, drafter: str, stream: bool = False, **kw):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                          stream=stream, logprobs=True, top_logprobs=3,
                                          extra_body={"drafter": drafter, "return_spec_decode": True},
                                          **kw)


def _close(a: list[float], b: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_chat_logprobs_equal_under_speculation_and_streamed(client):
    plain, spec = _chat(client, "none"), _chat(client, "ngram:min=1")
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.model_extra["spec_decode"]["accepted"] > 0, "nothing accepted: the test would pass vacuously"
    want, got = plain.choices[0].logprobs.content, spec.choices[0].logprobs.content
    assert len(got) == spec.usage.completion_tokens == len(want)
    assert [e.token for e in got] == [e.token for e in want]
    _close([e.logprob for e in got], [e.logprob for e in want])
    for e in got:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy
        try:  # a token's string is its bytes' text, or OpenAI's "bytes:\\x.." for part of a character
            assert bytes(e.bytes).decode("utf-8") == e.token
        except UnicodeDecodeError:
            assert e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs),
                                                             reverse=True)
    raw = b"".join(bytes(e.bytes) for e in got)
    assert raw.decode("utf-8", errors="replace").startswith(spec.choices[0].message.content)

    chunks = list(_chat(client, "ngram:min=1", stream=True, stream_options={"include_usage": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in got]
    _close([e.logprob for e in streamed], [e.logprob for e in got])
    assert ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == spec.choices[0].message.content)
    assert chunks[0].choices[0].logprobs is None  # the role chunk has no tokens


def _completion(client, drafter: str, stream: bool = False):
    return client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, logprobs=2,
                                     stream=stream,
                                     extra_body={"drafter": drafter, "return_spec_decode": True})


def test_completion_logprobs_legacy_shape_equal_under_speculation_and_streamed(client):
    plain, spec = _completion(client, "none"), _completion(client, "ngram:min=1")
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.model_extra["spec_decode"]["accepted"] > 0
    want, got = plain.choices[0].logprobs, spec.choices[0].logprobs
    assert got.tokens == want.tokens and len(got.tokens) == spec.usage.completion_tokens
    _close(got.token_logprobs, want.token_logprobs)
    assert got.text_offset == want.text_offset and got.text_offset[0] == 0
    assert got.text_offset == sorted(got.text_offset) and got.text_offset[-1] <= len(spec.choices[0].text)
    for token, lp, top in zip(got.tokens, got.token_logprobs, got.top_logprobs, strict=True):
        assert (1 <= len(top) <= 3 and top[token] == pytest.approx(lp)
                and max(top.values()) == pytest.approx(lp))

    chunks = list(_completion(client, "ngram:min=1", stream=True))
    lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for lp in lps for t in lp.tokens] == got.tokens
    assert [o for lp in lps for o in lp.text_offset] == got.text_offset
    _close([v for lp in lps for v in lp.token_logprobs], got.token_logprobs)
    assert "".join(c.choices[0].text for c in chunks) == spec.choices[0].text


# ---- forced tokens -------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "enum": ["search", "weather"]},
                   "query": {"type": "string", "maxLength": 20}},
    "required": ["name", "query"],
    "additionalProperties": False,
}


def test_forced_tokens_are_a_metric_and_a_per_request_count(server, client):
    before = server.metrics().get("specdec:spec_decode_num_forced_tokens_total", 0.0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[USER], max_tokens=60, temperature=0,
        extra_body={"drafter": "none", "return_spec_decode": True},
        response_format={"type": "json_schema",
                         "json_schema": {"name": "call", "schema": SCHEMA, "strict": True}},
    )
    spec = reply.model_extra["spec_decode"]
    assert spec["forced_tokens"] > 0 and spec["drafted"] == 0 and spec["accepted"] == 0
    after = server.metrics()["specdec:spec_decode_num_forced_tokens_total"]
    assert after - before == spec["forced_tokens"]
