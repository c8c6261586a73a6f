"""End-to-end engine behaviour on tiny random models: losslessness and stopping rules."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import save_loaded, tiny_llama, tiny_tokenizer
from specdec import Engine, SpecdecError
from specdec.backends import prefix_cache as backend_mod
from specdec.backends.hf import HFBackend
from specdec.drafters.draft_model import ModelDrafter

PROMPTS = ["def add(a, b):", '{"name": "search", "arguments": {"query": "weather', "The quick brown fox"]
MAX_NEW = 48


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


_HF_CACHE: dict = {}


def hf_greedy(target, prompt_ids, max_new_tokens):
    key = (id(target.model), tuple(prompt_ids), max_new_tokens, tuple(sorted(target.eos_token_ids)))
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _hf_greedy(target, prompt_ids, max_new_tokens)
    return _HF_CACHE[key]


def _hf_greedy(target, prompt_ids, max_new_tokens):
    ids = torch.tensor([prompt_ids])
    out = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=sorted(target.eos_token_ids), pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


def perfect_drafter(target):
    """The target drafting for itself: every draft token should be accepted."""
    return ModelDrafter(HFBackend(target.model), target.eos_token_ids)


def random_drafter(target):
    return ModelDrafter(HFBackend(tiny_llama(seed=7).model), target.eos_token_ids)


DRAFTERS = {
    "none": lambda t: "none",
    "ngram": lambda t: "ngram:min=1",
    "perfect": perfect_drafter,
    "random": random_drafter,
    "random-tokens": lambda t: "random:seed=3",  # the `random` drafter: uniform tokens, none accepted
}


@pytest.mark.parametrize("k", ["auto", 1, 5])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_equals_plain_and_transformers(target, drafter, k):
    engine = Engine(target=target, drafter=DRAFTERS[drafter](target), k=k)
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=MAX_NEW, chat=False)
        expected = hf_greedy(target, result.prompt_ids, MAX_NEW)
        assert result.token_ids == expected, f"{drafter} k={k} diverged on {prompt!r}"
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
        assert result.stats.num_emitted_tokens == len(result.token_ids)
    if drafter == "none":
        assert drafted == 0
        return
    assert drafted > 0, "nothing was drafted: the test would pass vacuously"
    if drafter == "perfect":
        assert accepted == drafted
    elif drafter == "ngram":
        assert accepted > 0
    else:  # a random draft is almost never right
        assert accepted < drafted


def test_perfect_drafter_takes_k_plus_one_tokens_per_step(target):
    engine = Engine(target=target, drafter=perfect_drafter(target), k=4)
    result = engine.generate(PROMPTS[0], max_new_tokens=25, chat=False)
    assert result.stats.accept_lengths == [5] * 5
    assert result.stats.mean_accepted_length == 5.0
    assert result.stats.accepted_per_pos == [5, 5, 5, 5]


def test_max_new_tokens_inside_a_block(target):
    plain = Engine(target=target, drafter="none").generate(PROMPTS[1], max_new_tokens=40, chat=False)
    for n in (1, 2, 7, 13):
        result = Engine(target=target, drafter=perfect_drafter(target), k=8).generate(
            PROMPTS[1], max_new_tokens=n, chat=False
        )
        assert result.token_ids == plain.token_ids[:n]
        assert result.finish_reason == "length"


def _stop_string_inside_second_block(target):
    """A two-token stop string at tokens i, i+1 (9 <= i < 16) that does not occur earlier."""
    tok = target.tokenizer
    for prompt in PROMPTS:
        plain = Engine(target=target, drafter="none").generate(prompt, max_new_tokens=40, chat=False)
        for i in range(9, 16):
            stop = tok.decode(plain.token_ids[i : i + 2])
            if "\ufffd" not in stop and plain.text.find(stop) == len(tok.decode(plain.token_ids[:i])):
                return prompt, plain, stop
    raise AssertionError("no usable stop string in the tiny model's output")


def test_stop_string_inside_an_accepted_block(target):
    prompt, plain, stop = _stop_string_inside_second_block(target)
    result = Engine(target=target, drafter=perfect_drafter(target), k=8).generate(
        prompt, max_new_tokens=40, stop=[stop], chat=False
    )
    tok = target.tokenizer
    assert result.text == plain.text[: plain.text.find(stop)]
    assert result.finish_reason == "stop"
    # The ids end with the token that completed the stop string, inside the second block of 9.
    assert result.token_ids == plain.token_ids[: len(result.token_ids)]
    assert stop in tok.decode(result.token_ids) and stop not in tok.decode(result.token_ids[:-1])
    assert 9 < len(result.token_ids) < 18
    assert result.stats.accept_lengths[0] == 9


def _eos_mid_reply(target):
    """(prompt, its plain reply, a token that first appears at position >= 10 of that reply, a
    copy of the target whose EOS it is)."""
    prompt, plain, eos = next(
        (p, plain, t)
        for p in PROMPTS
        for plain in [Engine(target=target, drafter="none").generate(p, max_new_tokens=30, chat=False)]
        for i, t in enumerate(plain.token_ids)
        if 10 <= i < 17 and t not in plain.token_ids[:i]
    )
    model = copy.deepcopy(target.model)
    model.generation_config.eos_token_id = [eos]
    return prompt, plain, eos, type(target)(name="tiny-eos", model=model, tokenizer=target.tokenizer)


def test_eos_inside_an_accepted_block(target):
    prompt, plain, eos, with_eos = _eos_mid_reply(target)
    result = Engine(target=with_eos, drafter=perfect_drafter(with_eos), k=8).generate(
        prompt, max_new_tokens=30, chat=False
    )
    end = plain.token_ids.index(eos) + 1
    assert result.token_ids == plain.token_ids[:end] == hf_greedy(with_eos, result.prompt_ids, 30)
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("drafter", ["none", "perfect"])
def test_ignore_eos_runs_past_it_to_the_limit(target, drafter):
    prompt, plain, eos, with_eos = _eos_mid_reply(target)
    draft = DRAFTERS[drafter](with_eos)
    result = Engine(target=with_eos, drafter=draft, k=8).generate(prompt, max_new_tokens=30, chat=False,
                                                                  ignore_eos=True)
    assert result.token_ids == plain.token_ids and eos in plain.token_ids[:-1] and len(plain.token_ids) == 30
    assert result.finish_reason == "length"
    if drafter == "perfect":
        assert result.stats.accepted_per_pos[0] > 0, "nothing accepted: the test would pass vacuously"


def test_context_limit_stops_cleanly():
    small = tiny_llama(seed=0, max_positions=40)
    prompt = list(range(10, 40))  # 30 tokens
    plain = Engine(target=small, drafter="none").generate(prompt, max_new_tokens=100)
    spec = Engine(target=small, drafter=perfect_drafter(small), k=8).generate(prompt, max_new_tokens=100)
    assert spec.token_ids == plain.token_ids
    assert spec.finish_reason == plain.finish_reason == "length"
    assert len(prompt) + len(spec.token_ids) == 41  # the cache is full; the last token is emitted, not fed
    with pytest.raises(SpecdecError, match="maximum context length"):
        Engine(target=small, drafter="none").generate(list(range(5, 45)), max_new_tokens=4)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": [], "max_new_tokens": 3}, "prompt"),
        ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "temperature": 1, "top_p": 0}, "top_p"),
        ({"prompt": "hi", "temperature": 1, "top_p": 1.01}, "top_p"),
    ],
)
def test_bad_input_is_a_specdec_error(target, kwargs, param):
    with pytest.raises(SpecdecError) as err:
        Engine(target=target, drafter="none").generate(**kwargs)
    assert err.value.param == param


def test_stream_deltas_add_up_to_the_text(target):
    engine = Engine(target=target, drafter="ngram:min=1", k=4)
    plain = engine.generate(PROMPTS[0], max_new_tokens=30, chat=False)
    stream = engine.stream(PROMPTS[0], max_new_tokens=30, chat=False)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text == plain.text
    _, _, stop = _stop_string_inside_second_block(target)
    plain = engine.generate(PROMPTS[1], max_new_tokens=30, chat=False)
    stream = engine.stream(PROMPTS[1], max_new_tokens=30, stop=[stop], chat=False)
    assert "".join(stream) == stream.result.text == plain.text[: plain.text.find(stop)]


def test_chat_prompt_uses_the_template(target):
    engine = Engine(target=target, drafter="none")
    ids = engine.encode_prompt("hello")
    assert target.tokenizer.decode(ids).startswith("<|user|>hello</s><|assistant|>")


def test_sampling_is_seeded_and_perfect_drafts_are_all_accepted(target):
    engine = Engine(target=target, drafter=perfect_drafter(target), k=4)
    runs = [engine.generate(PROMPTS[0], max_new_tokens=30, temperature=0.8, seed=3, chat=False)
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    # draft probs equal target probs, so min(1, target/draft) = 1 (up to float rounding)
    assert runs[0].stats.acceptance_rate > 0.95


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_distribution_end_to_end(temperature):
    """The second sampled token follows the target's exact marginal distribution.

    An 8-token vocabulary keeps the sampling noise small enough for a tight bound.
    """
    target = tiny_llama(seed=3, vocab=8)
    draft = tiny_llama(seed=7, vocab=8)
    prompt = [5, 1, 2]
    with torch.no_grad():
        first = (target.model(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)  # [V]
        both = torch.tensor([prompt + [t] for t in range(8)])
        second = (target.model(both).logits[:, -1] / temperature).softmax(-1)  # [V, V]
    exact = (first[:, None] * second).sum(0)  # [V] marginal of the second token

    engine = Engine(target=target, drafter=ModelDrafter(HFBackend(draft.model), set()), k=2)
    engine.eos_token_ids = set()  # always generate two tokens
    trials = 1500
    counts = torch.zeros(8)
    drafted = accepted = 0
    for seed in range(trials):
        result = engine.generate(prompt, max_new_tokens=2, temperature=temperature, seed=seed)
        counts[result.token_ids[1]] += 1
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted  # both paths, accept and reject, were exercised
    tv = 0.5 * float((counts / trials - exact).abs().sum())
    # Expected TV of an exact sampler: 0.5 * sum_i E|p̂_i - p_i| ≈ 0.5 * sum_i sqrt(2 p_i (1 - p_i) / (pi N)).
    noise = 0.5 * float((2 * exact * (1 - exact) / (torch.pi * trials)).sqrt().sum())
    wrong = 0.5 * float((exact - first).abs().sum())  # e.g. a sampler that confuses positions
    assert tv < 2 * noise < wrong, (tv, noise, wrong)


def test_model_drafter_refuses_a_different_tokenizer(target, tmp_path):
    other = tiny_llama(seed=1)
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_tokens(["<extra-token>"])
    other.tokenizer = tok
    path = save_loaded(other, tmp_path / "other")
    with pytest.raises(SpecdecError, match="different tokenizer"):
        Engine(target=target, drafter=f"model:{path}")


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_model_drafter_from_a_directory(target, tmp_path, backend):
    """A model draft runs where `auto` puts it (native for a llama) unless its spec names a
    backend; the same weights on the target's backend accept every draft."""
    path = save_loaded(tiny_llama(seed=0), tmp_path / "same")
    # fp32 on native: int4 targets prefill through dense layers, which an int4 draft does not
    spec = f"model:{path}:precision=fp32" if backend == "native" else f"model:{path}:backend=hf"
    options = {"precision": "fp32"} if backend == "native" else {}
    engine = Engine(target=target, drafter=spec, k=4, backend=backend, backend_options=options)
    assert type(engine.drafter.backend).__name__ == ("NativeSequence" if backend == "native" else "HFBackend")
    result = engine.generate(PROMPTS[0], max_new_tokens=20, chat=False)
    assert result.stats.acceptance_rate == 1.0  # same weights, loaded from disk


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_multi_turn_prompts_reuse_the_cached_prefix_and_stay_exact(target, drafter, monkeypatch):
    """A conversation resent with one more turn prefills only the new part, and its output
    equals a cold start's (each turn checked against transformers' greedy decoding)."""
    monkeypatch.setattr(backend_mod, "PREFILL_CHUNK", 4)
    engine = Engine(target, drafter=drafter if drafter == "none" else "ngram:min=1",
                    k=0 if drafter == "none" else 4)
    prompt = target.tokenizer.encode(PROMPTS[1])
    cached = []
    for _ in range(3):
        result = engine.generate(prompt, max_new_tokens=16)
        assert result.token_ids == hf_greedy(target, prompt, 16)
        cached.append(result.stats.cached_prompt_tokens)
        prompt = prompt + result.token_ids + target.tokenizer.encode(PROMPTS[0])
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    cold = Engine(target, drafter="none", k=0, prefix_cache=False)
    assert cold.generate(prompt, max_new_tokens=4).stats.cached_prompt_tokens == 0


def _conversation(engine, target, turns=3, max_new=16):
    """Resend a growing conversation: each turn is the last prompt, its answer and new text."""
    prompt, outputs, cached, accepted = target.tokenizer.encode(PROMPTS[1]), [], [], 0
    for i in range(turns):
        result = engine.generate(prompt, max_new_tokens=max_new)
        outputs.append(result.token_ids)
        cached.append(result.stats.cached_prompt_tokens)
        accepted += result.stats.num_accepted_tokens
        prompt = prompt + result.token_ids + target.tokenizer.encode(PROMPTS[i % 2])
    return outputs, cached, accepted


@pytest.mark.parametrize(
    ("backend", "drafter", "k"),
    [("native", "ngram:min=1", 4), ("native", "suffix:tree=1", 6), ("hf", "ngram:min=1", 4)],
    ids=["native-ngram", "native-suffix-tree", "hf-ngram"],
)
def test_decoded_prefix_cache_reuses_answers_and_speculation_stays_exact(target, backend, drafter, k,
                                                                         monkeypatch):
    """--prefix-cache decoded: the next turn keeps the previous answer's keys as decoding
    wrote them. Plain and speculative decoding, each through its own conversation, agree
    token for token, and they keep more than prompt-only caching does."""
    monkeypatch.setattr(backend_mod, "PREFILL_CHUNK", 4)
    options = {"precision": "fp32"} if backend == "native" else None
    plain = Engine(target, "none", k=0, backend=backend, backend_options=options, prefix_cache="decoded")
    spec = Engine(target, drafter, k=k, backend=backend, backend_options=options, prefix_cache="decoded")
    prompt_only = Engine(target, "none", k=0, backend=backend, backend_options=options)
    want, cached_plain, _ = _conversation(plain, target)
    got, cached_spec, accepted = _conversation(spec, target)
    _, cached_prompt_only, _ = _conversation(prompt_only, target)
    assert got == want and accepted > 0
    assert cached_spec == cached_plain  # the same keys kept, so the same bits read
    assert all(d > p for d, p in zip(cached_plain[1:], cached_prompt_only[1:], strict=True))
    with pytest.raises(SpecdecError, match="prefix.cache must be one of"):
        Engine(target, "none", k=0, prefix_cache="everything")


def test_draft_device_runs_the_draft_on_its_own_device(target, tmp_path):
    """--draft-device places a model drafter (through the native backend, which takes a
    device); the target stays where it is. Only cpu exists here: scripts/gpu_check.py runs
    the cpu-draft / cuda-target split when a GPU is lent."""
    path = save_loaded(tiny_llama(seed=0), tmp_path / "same")
    engine = Engine(target=target, drafter=f"model:{path}", k=4, draft_device="cpu")
    draft_backend = engine.drafter.backend
    assert type(draft_backend).__name__ == "NativeSequence" and str(draft_backend.device) == "cpu"
    result = engine.generate(PROMPTS[0], max_new_tokens=20, chat=False)
    assert result.token_ids == hf_greedy(target, target.tokenizer.encode(PROMPTS[0]), 20)
    assert result.stats.num_accepted_tokens > 0
    with pytest.raises(SpecdecError):
        Engine(target=target, drafter=f"model:{path}", k=4, draft_device="tpu")
