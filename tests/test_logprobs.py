"""Logprobs of emitted tokens (logprobs.py): the same values whether a token was an accepted
draft, a recovered or bonus token, or came from plain decoding, and equal to the target's own
log-softmax at that position."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from specdec import Engine, SpecdecError
from specdec.logprobs import MIN_LOGPROB, token_logprobs

PROMPTS = ["def add(a, b):\n    return a + b\ndef add(a, b):",
           "The quick brown fox jumps over the lazy dog. The quick"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "enum": ["search", "weather"]}, "query": {"type": "string"}},
    "required": ["name", "query"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


def reference(target, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """The target's log-softmax over one forward of the whole sequence: [len(token_ids), V]."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = target.model(ids).logits[0, len(prompt_ids) - 1 : -1]
    return logits.float().log_softmax(-1)


def values(result) -> tuple[list[float], list[list[int]], list[list[float]]]:
    lps = result.logprobs
    return ([e.logprob for e in lps], [[i for i, _ in e.top] for e in lps],
            [[v for _, v in e.top] for e in lps])


@pytest.mark.parametrize(
    ("backend", "options", "drafter", "k", "exact"),
    [
        ("hf", None, "ngram:min=1", 4, False),
        ("native", {"precision": "int4"}, "ngram:min=1", 4, True),
        ("native", {"precision": "int4"}, "suffix:tree=1", 6, True),
    ],
    ids=["hf-ngram", "native-int4-ngram", "native-int4-suffix-tree"],
)
def test_speculative_logprobs_equal_plain_ones(target, backend, options, drafter, k, exact):
    """Greedy: the tokens match and so do their logprobs and top-5 (bit for bit where the
    backend's scoring is batch-invariant, the native quantized kernels; to 1e-5 on hf)."""
    plain = Engine(target, "none", k=0, backend=backend, backend_options=options)
    spec = Engine(target, drafter, k=k, backend=backend, backend_options=options)
    accepted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=40, chat=False, logprobs=5)
        got = spec.generate(prompt, max_new_tokens=40, chat=False, logprobs=5)
        assert got.token_ids == want.token_ids
        assert len(got.logprobs) == len(got.token_ids) and [e.token for e in got.logprobs] == got.token_ids
        accepted += got.stats.num_accepted_tokens
        (lp_got, ids_got, top_got), (lp_want, ids_want, top_want) = values(got), values(want)
        assert ids_got == ids_want
        if exact:
            assert lp_got == lp_want and top_got == top_want
        else:
            torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_want), atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(top_got), torch.tensor(top_want), atol=1e-5, rtol=0)
        for e in got.logprobs:  # greedy: the emitted token is a likeliest of its row (int4 makes ties)
            assert e.top[0][1] == e.logprob and len(e.top) == 5
    assert accepted > 0, "nothing was accepted: the test would pass vacuously"


def test_sampled_logprobs_are_the_targets_raw_distribution(target):
    """At T > 0 too (accepted, recovered and bonus tokens), each logprob is the target's
    log-softmax at that position, before temperature and top-k: one full forward agrees."""
    spec = Engine(target, "ngram:min=1", k=4)
    for prompt in PROMPTS:
        ids = target.tokenizer.encode(prompt)
        result = spec.generate(ids, max_new_tokens=32, temperature=0.7, top_k=20, seed=3, logprobs=2)
        ref = reference(target, ids, result.token_ids)
        picked = ref.gather(-1, torch.tensor(result.token_ids).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor([e.logprob for e in result.logprobs]), picked, atol=1e-4,
                                   rtol=0)
        torch.testing.assert_close(torch.tensor([[v for _, v in e.top] for e in result.logprobs]),
                                   ref.topk(2, -1).values, atol=1e-4, rtol=0)


def test_logprobs_do_not_change_the_tokens_and_stop_where_they_stop(target):
    spec = Engine(target, "ngram:min=1", k=4)
    without = spec.generate(PROMPTS[1], max_new_tokens=30, chat=False)
    assert without.logprobs is None
    text = without.text
    stop = text[5:8]
    with_lp = spec.generate(PROMPTS[1], max_new_tokens=30, chat=False, logprobs=0, stop=[stop])
    cut = spec.generate(PROMPTS[1], max_new_tokens=30, chat=False, stop=[stop])
    assert with_lp.token_ids == cut.token_ids and with_lp.text == cut.text
    assert [e.token for e in with_lp.logprobs] == with_lp.token_ids  # none past the stop string
    assert all(e.top == () for e in with_lp.logprobs)
    with pytest.raises(SpecdecError, match="logprobs"):
        spec.generate(PROMPTS[0], logprobs=21)


def test_constrained_logprobs_follow_the_mask_and_match_plain(target):
    """Under a grammar the rows are masked first (as vLLM does): forced tokens have logprob 0,
    every alternative is allowed, and speculation (with forced drafts) changes nothing."""
    ids = target.tokenizer.encode(PROMPTS[0])
    plain = Engine(target, "none", k=0).generate(ids, max_new_tokens=40, json_schema=SCHEMA, logprobs=3)
    spec = Engine(target, "ngram:min=1", k=4).generate(ids, max_new_tokens=40, json_schema=SCHEMA, logprobs=3)
    assert spec.token_ids == plain.token_ids and spec.stats.num_forced_tokens > 0
    torch.testing.assert_close(torch.tensor(values(spec)[0]), torch.tensor(values(plain)[0]), atol=1e-5,
                               rtol=0)
    assert sum(e.logprob == 0.0 for e in spec.logprobs) >= spec.stats.num_forced_tokens
    assert any(len(e.top) < 3 for e in spec.logprobs)  # rows with fewer allowed tokens list only those
    assert all(v > MIN_LOGPROB for e in spec.logprobs for _, v in e.top)


def test_masked_tokens_are_no_alternatives_and_floor_at_minus_9999():
    logits = torch.tensor([[0.0, float("-inf"), 1.0], [2.0, 2.0, float("-inf")]])  # [2, V=3]
    out = token_logprobs(logits, [0, 1, 1], [2, 0, 2], top_n=3)
    assert [e.token for e in out] == [2, 0, 2]
    assert [i for i, _ in out[0].top] == [2, 0] and len(out[1].top) == 2
    assert out[1].logprob == pytest.approx(-0.6931472) and out[2].logprob == MIN_LOGPROB
