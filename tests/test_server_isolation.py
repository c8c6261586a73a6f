"""Issue 16 through a real `specdec serve` process on 127.0.0.1, driven by the official client:
each `--prefix-cache` mode does what it says (and a `cache_salt` scopes it), and a request
whose drafter raises fails alone while the requests batched with it finish unchanged."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import save_loaded, tiny_llama
from served_helpers import ServerProcess
from specdec.engine import Engine
from specdec.models import load_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_loaded(tiny_llama(0, max_positions=1024), tmp_path_factory.mktemp("tiny-model-1k"))


@pytest.mark.parametrize("mode", ["off", "prompt", "decoded"])
def test_each_prefix_cache_mode_through_a_real_server(model_dir, mode):
    """Turn 2 of a conversation (turn 1's 300 prompt tokens, its answer, 20 new tokens) reports
    as cached: nothing with `off`; turn 1's prompt in whole 128-token chunks with `prompt`;
    the prompt and the answer (all but its last token) with `decoded`. A request with another
    `cache_salt` never reuses what the first salt cached."""
    ids = [4 + (i * 37) % 390 for i in range(300)]  # ordinary tokens, no special ones
    plain = Engine(load_model(model_dir), drafter="none", k=0)
    answer = plain.generate(ids, max_new_tokens=24).token_ids
    turn2 = ids + answer + [4 + (i * 11) % 390 for i in range(20)]
    want = {"off": 0, "prompt": 256, "decoded": len(ids) + len(answer) - 1}[mode]
    server = ServerProcess(model_dir, "--prefix-cache", mode, "--served-model-name", "tiny")
    try:
        client = server.client()

        def complete(prompt, salt="a", n=24):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                              extra_body={"cache_salt": salt})

        first = complete(ids)
        assert first.choices[0].text == plain.tokenizer.decode(answer, skip_special_tokens=True)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        other_salt = complete(turn2, salt="b", n=4)
        assert other_salt.usage.prompt_tokens_details.cached_tokens == 0
        second = complete(turn2, n=8)
        assert second.usage.prompt_tokens_details.cached_tokens == want
        expected = plain.generate(turn2, max_new_tokens=8).token_ids
        if mode != "decoded":  # decoded reuse may continue differently (docs/models.md); the others are exact
            assert second.choices[0].text == plain.tokenizer.decode(expected, skip_special_tokens=True)
    finally:
        server.close()


def test_a_request_whose_drafter_raises_fails_alone_on_a_real_server(model_dir):
    """Five concurrent requests share the batch; the drafter raises when the short one whose
    prompt says POISON ends, while the others still decode. That one gets an error; the other
    four get what they get when served alone, and the server keeps serving."""
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog. The quick brown" for i in range(4)]
    poison = "POISON: the quick brown fox jumps over the lazy dog. The quick brown"
    server = ServerProcess(model_dir, "--drafter", "test-faulty", "--max-batch", "8",
                           "--served-model-name", "tiny", plugin="faulty_drafter_plugin")
    try:
        client = server.client()

        def complete(prompt, n=40):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)

        alone = [complete(p).choices[0].text for p in prompts]
        jobs = [(p, 40) for p in prompts[:2]] + [(poison, 6)] + [(p, 40) for p in prompts[2:]]
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(complete, p, n) for p, n in jobs]
            with pytest.raises(openai.InternalServerError):
                futures[2].result()
            together = [f.result().choices[0].text for i, f in enumerate(futures) if i != 2]
        assert together == alone
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert complete(prompts[0]).choices[0].text == alone[0]
    finally:
        server.close()
