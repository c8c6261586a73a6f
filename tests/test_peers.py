"""The bench's llama.cpp peer keeps its prompt cache across a conversation's turns, as
llama-server does, so the comparison with specdec's prefix-caching runners is fair."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec.bench.peers import LlamaCppPeer, _gguf_path

# A llama-cpp-python built for another cpu dies with SIGILL inside decode: try it in a child first.
PROBE = """
from llama_cpp import Llama
from specdec.bench.peers import _gguf_path
llm = Llama(model_path=str(_gguf_path("smollm2-135m")), n_ctx=64, verbose=False)
llm.eval(llm.tokenize(b"The harbour office opened at seven"))
"""


@pytest.fixture(scope="module")
def working_llamacpp():
    pytest.importorskip("llama_cpp")
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"llama-cpp-python cannot decode on this machine (exit {probe.returncode})")


@pytest.mark.slow
@pytest.mark.parametrize("reuse", [True, False])
def test_llamacpp_peer_feeds_only_what_follows_the_cached_prefix(smollm2, working_llamacpp, reuse):
    peer = LlamaCppPeer(_gguf_path("smollm2-135m"), smollm2.eos_token_ids, n_ctx=512, reuse_prefix=reuse)
    fed: list[int] = []
    eval_tokens = peer.llm.eval
    peer.llm.eval = lambda tokens: (fed.append(len(tokens)), eval_tokens(tokens))[1]
    first = smollm2.tokenizer.encode(
        "The harbour office opened at seven, and the ferries waited for the fog.")
    reply = peer.run(first, 8, 0.0, 0).token_ids
    fed.clear()
    second = first + reply + smollm2.tokenizer.encode(" Then the captains argued.")
    again = peer.run(second, 8, 0.0, 0).token_ids
    prompt_fed = fed[0]  # the first eval reads the prompt; the rest are one sampled token each
    if reuse:
        assert prompt_fed < len(second) - len(first)  # the first turn's prompt and reply were kept
    else:
        assert prompt_fed == len(second)
    assert len(again) == 8
