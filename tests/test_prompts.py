"""prompts.encode: the one prompt encoding the engine, server, benchmark and training share."""

from __future__ import annotations

import copy

import pytest

from conftest import tiny_tokenizer
from specdec.errors import SpecdecError
from specdec.prompts import encode


def test_a_user_string_is_wrapped_in_the_chat_template():
    tok = tiny_tokenizer()
    ids = encode(tok, "hello")
    assert tok.decode(ids) == "<|user|>hello</s><|assistant|>"
    assert ids == encode(tok, [{"role": "user", "content": "hello"}])


def test_raw_text_and_token_ids():
    tok = tiny_tokenizer()
    assert encode(tok, "hello", chat=False) == tok.encode("hello", add_special_tokens=True)
    assert encode(tok, [5, 6, 7]) == [5, 6, 7]
    plain = copy.copy(tok)
    plain.chat_template = None  # no template: a user string is raw text
    assert encode(plain, "hello") == tok.encode("hello", add_special_tokens=True)


def test_the_template_writes_special_tokens_once():
    tok = tiny_tokenizer()
    ids = encode(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                       {"role": "user", "content": "c"}])
    assert tok.decode(ids) == "<|user|>a</s><|assistant|>b</s><|user|>c</s><|assistant|>"


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message", "param"),
    [
        ("", {}, "the prompt is empty", "prompt"),
        ("   ", {"chat": False}, "the prompt is empty", "prompt"),
        ([], {}, "the prompt is empty", "prompt"),
        (None, {}, "the prompt is empty", "prompt"),
        ([5] * 8, {"max_length": 8}, "the prompt has 8 tokens; the maximum context length is 8", "prompt"),
    ],
)
def test_errors_are_one_line_with_a_param(prompt, kwargs, message, param):
    with pytest.raises(SpecdecError) as err:
        encode(tiny_tokenizer(), prompt, **kwargs)
    assert err.value.message.startswith(message) and "\n" not in err.value.message
    assert err.value.param == param


def test_a_template_that_rejects_the_messages_is_a_specdec_error():
    tok = copy.copy(tiny_tokenizer())
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(SpecdecError,
                       match="the chat template rejected the messages: roles must alternate") as err:
        encode(tok, [{"role": "user", "content": "x"}])
    assert err.value.param == "messages"
