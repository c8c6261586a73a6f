"""Structured outputs: grammar-constrained decoding is exact under speculation, forced tokens
are drafted for free, and the grammar state follows exactly what was emitted."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_llama
from specdec import Engine, SpecdecError
from specdec.backends.hf import HFBackend
from specdec.drafters import Draft, Drafter
from specdec.drafters.draft_model import ModelDrafter
from specdec.grammar import (
    ConstrainedDraft,
    GrammarMatcher,
    constraint_from_response_format,
    grammar,
    json_object,
    json_schema,
)
from specdec.request import Prepared, Request
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.sequence import Runtime, Sequence
from specdec.verify import verify_sampling

TOOL = {  # a tool call: fixed keys, an enum, a free string
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["search", "weather"]},
        "arguments": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
ROWS = {  # an array of objects: keys repeat, so drafters that copy the context get accepted
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": ["a", "fox", "dog"]},
                               "value": {"type": "integer"}},
                "required": ["name", "value"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
ENUMS = {"type": "array",
         "items": {"type": "string", "enum": ["search", "weather in Paris", "quick brown fox"]}}
SCHEMAS = {"tool": TOOL, "rows": ROWS, "enums": ENUMS}
PROMPTS = ['{"name": "search", "arguments": {"query": "weather in Paris"}}', "The quick brown fox",
           "| name | value |"]
MAX_NEW = 48


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


_PLAIN: dict = {}


def plain_constrained(target, prompt_ids, schema, max_new_tokens=MAX_NEW):
    """Constrained greedy decoding without any engine: transformers' forward with its cache,
    one token at a time, the grammar's mask on each row and each token fitted to what is left
    of the budget (the closing completion where it is due), until the grammar stops."""
    key = (id(target.model), tuple(prompt_ids), json.dumps(schema), max_new_tokens)
    if key in _PLAIN:
        return _PLAIN[key]
    matcher = GrammarMatcher(json_schema(schema, strict=True), target.tokenizer, target.eos_token_ids)
    out, ids, cache = [], torch.tensor([prompt_ids]), DynamicCache(config=target.model.config)
    with torch.no_grad():
        while len(out) < max_new_tokens:
            step = target.model(ids, cache=cache, use_cache=True)
            budget = max_new_tokens - len(out)
            token = int(matcher.mask_logits(step.logits[0, -1:], [int(ids[0, -1])], budget).argmax())
            fitted, _ = matcher.fit([token], budget)
            if not fitted:  # complete where it is: the token would leave it unclosable
                break
            token = fitted[0]
            out.append(token)
            # EOS, or the grammar stopped
            if token in target.eos_token_ids or matcher.advance([token]) is not None:
                break
            ids = torch.tensor([[token]])
    _PLAIN[key] = out
    return out


class ScriptedDrafter(Drafter):
    """Proposes the known `answer`, except that its last token is one the grammar rejects (a
    special token): drafts that are accepted, then one the grammar must cut."""

    name = "scripted"

    def __init__(self, bad_token: int):
        self.bad_token, self.answer = bad_token, []

    def begin(self, prompt_ids, params, generator) -> None:
        self.prompt_len = len(prompt_ids)

    def propose(self, context_ids, k):
        done = len(context_ids) - self.prompt_len
        return Draft([*self.answer[done : done + k - 1], self.bad_token][:k])


def _model_drafter(target, seed=None):
    model = target.model if seed is None else tiny_llama(seed=seed).model
    return ModelDrafter(HFBackend(model), target.eos_token_ids)


DRAFTERS = {
    "none": (lambda t: "none", 0),
    "ngram": (lambda t: "ngram:min=1", 4),
    "suffix": (lambda t: "suffix", 6),
    "suffix-tree": (lambda t: "suffix:tree=1", 6),  # trees become chains under a grammar
    "unconstrained-self": (lambda t: _model_drafter(t), 5),  # the target, blind to the grammar
    "scripted-violating": (lambda t: ScriptedDrafter(t.tokenizer.convert_tokens_to_ids("<|user|>")), 5),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_constrained_speculation_equals_plain_constrained_decoding(target, drafter, monkeypatch):
    cuts = []
    original = GrammarMatcher.draft

    def spy(self, forced, tokens, probs):
        planned = original(self, forced, tokens, probs)
        cuts.append(planned.rejected is not None)
        return planned

    monkeypatch.setattr(GrammarMatcher, "draft", spy)
    make, k = DRAFTERS[drafter]
    engine = Engine(target, make(target), k=k)
    drafted = accepted = forced = 0
    for name, schema in SCHEMAS.items():
        for prompt in PROMPTS:
            ids = target.tokenizer.encode(prompt)
            expected = plain_constrained(target, ids, schema)
            engine.drafter.answer = expected  # read by the scripted drafter only
            result = engine.generate(ids, max_new_tokens=MAX_NEW, json_schema=schema)
            assert result.token_ids == expected, f"{drafter} diverged: {name} {prompt!r}"
            if result.finish_reason == "stop":
                json.loads(result.text)  # a complete reply parses
            stats = result.stats
            assert stats.num_emitted_tokens == len(result.token_ids)
            # each step emits its accepted and forced tokens plus one, but where the grammar stops
            steps_sum = stats.num_accepted_tokens + stats.num_forced_tokens + stats.num_steps
            assert steps_sum - (result.finish_reason == "stop") <= stats.num_emitted_tokens <= steps_sum
            drafted, accepted, forced = (drafted + stats.num_draft_tokens,
                                         accepted + stats.num_accepted_tokens,
                                         forced + stats.num_forced_tokens)
    assert forced > 0, "no forced tokens on schemas with fixed keys"
    if drafter == "none":
        assert drafted == 0
        return
    assert drafted > 0 and accepted > 0, "the test would pass vacuously"
    if drafter in ("unconstrained-self", "scripted-violating"):
        assert any(cuts) and accepted < drafted  # the grammar cut drafts before scoring


def test_forced_tokens_are_free_and_always_accepted(target):
    """Forced tokens lead the draft even with k = 0 (their rows allow only them), and the
    drafter's counts and per-position stats leave them out."""
    ids = target.tokenizer.encode(PROMPTS[0])
    result = Engine(target, "none", k=0).generate(ids, max_new_tokens=MAX_NEW, json_schema=TOOL)
    stats = result.stats
    assert result.token_ids == plain_constrained(target, ids, TOOL)
    assert stats.num_forced_tokens > 0 and stats.num_draft_tokens == 0 and stats.accepted_per_pos == []
    # a step emits one chosen token after its forced ones; the last may hold forced tokens only,
    # when they complete the reply (here: the closing completion, test_closing.py)
    chosen = len(result.token_ids) - stats.num_forced_tokens
    assert stats.num_steps in (chosen, chosen + 1) and chosen < len(result.token_ids)
    assert stats.summary()["forced_tokens"] == stats.num_forced_tokens
    matcher = GrammarMatcher(json_schema(TOOL), target.tokenizer, target.eos_token_ids)
    for token in result.token_ids:  # wherever tokens are forced, the mask allows exactly the first one
        forced = matcher.forced()
        allowed = matcher.masks([0], len(target.tokenizer))[0]
        if forced:
            assert allowed.nonzero().flatten().tolist() == [forced[0]]
        matcher.advance([token])


def test_grammar_stop_ends_the_reply_without_eos(target):
    ids = target.tokenizer.encode(PROMPTS[2])
    result = Engine(target, "none", k=0).generate(ids, max_new_tokens=80, json_schema=TOOL)
    assert result.finish_reason == "stop" and result.token_ids[-1] not in target.eos_token_ids
    assert json.loads(result.text)["name"] in ("search", "weather")


@pytest.mark.parametrize("drafter", ["ngram", "sampling-model"])
def test_matcher_holds_exactly_the_emitted_tokens_after_each_step(target, drafter):
    """After every step, rejected drafts included, the request's grammar state equals a fresh
    matcher fed the emitted tokens: same forced tokens, same mask."""
    tok = target.tokenizer
    temperature = 1.0 if drafter == "sampling-model" else 0.0
    engine = Engine(target, "ngram:min=1" if drafter == "ngram" else _model_drafter(target, seed=7), k=4)
    drafted = accepted = 0
    for prompt in PROMPTS:
        matcher = GrammarMatcher(json_schema(TOOL), tok, engine.eos_token_ids)
        job = Prepared(Request(prompt, sampling=SamplingParams(temperature), seed=1), tok.encode(prompt), 60,
                       matcher)
        seq = Sequence(engine.backend, engine.drafter, job, 4, Runtime(tok, engine.eos_token_ids))
        seq.start()
        while (tokens := seq.plan()) is not None:
            seq.advance(engine.backend.forward(tokens))
            reply = [t for t in seq.generated if t not in engine.eos_token_ids]
            assert matcher.history == reply
            fresh = GrammarMatcher(json_schema(TOOL), tok, engine.eos_token_ids)
            fresh.advance(reply)
            if not seq.done:
                assert matcher.forced() == fresh.forced()
                assert torch.equal(matcher.masks([reply[-1]], len(tok)), fresh.masks([reply[-1]], len(tok)))
        seq.finish()
        drafted, accepted = drafted + seq.stats.num_draft_tokens, accepted + seq.stats.num_accepted_tokens
    assert drafted > accepted > 0  # drafts were rejected, and accepted


# ---- sampling: exact against the constrained distribution ---------------------------------------

WORDS = 'start: "quick" | "brown" | "lazy" | "fox" | "dog"'


def _constrained_first_token(matcher, target_logits, draft_probs, params, gen):
    """One constrained step as Sequence.advance runs it: the draft token is sampled from an
    unconstrained draft distribution and cut if the grammar rejects it; the target's rows are
    masked; verification gets the rejected token too."""
    token = int(torch.multinomial(draft_probs, 1, generator=gen))
    planned = matcher.draft([], [token], draft_probs.unsqueeze(0))
    scored = target_logits[: len(planned.tokens) + 1]  # [1 + accepted drafts, V]
    logits = matcher.mask_logits(scored, [0, *planned.tokens])
    tokens, probs = planned.for_verification()
    result = verify_sampling(torch.tensor(tokens, dtype=torch.long), probs, logits_to_probs(logits, params),
                             gen)
    return result.emitted(tokens)[0]


def _sampling_setup(target):
    tok = target.tokenizer
    matcher = GrammarMatcher(grammar(WORDS), tok, target.eos_token_ids)
    vocab = len(tok)
    allowed = matcher.masks([0], vocab)[0]  # [V]
    gen = torch.Generator().manual_seed(0)
    target_logits = 2.0 * torch.randn(2, vocab, generator=gen)  # [2, V]
    # Among the allowed tokens the target gives one half its mass. The draft puts 60% of its
    # mass on tokens the grammar rejects and 40% on that one, so the residual is far from the
    # target: drawing from the target instead of the residual shows.
    good = allowed.nonzero().flatten()  # the first letters of the words: 8 tokens
    target_logits[0, good] = torch.linspace(-0.5, 0.5, len(good))
    target_logits[0, good[0]] = float(torch.log(target_logits[0, good[1:]].exp().sum()))
    draft_probs = torch.zeros(vocab)
    draft_probs[(~allowed).nonzero().flatten()[:5]] = 0.12
    draft_probs[good[0]] = 0.4
    return matcher, allowed, target_logits, draft_probs


@pytest.mark.parametrize(
    ("wrong", "params"),
    [
        (None, SamplingParams(temperature=1.0)),
        (None, SamplingParams(temperature=0.7, top_k=5)),
        ("drafts filtered, target rows not masked", SamplingParams(temperature=1.0)),
        ("rejected draft dropped", SamplingParams(temperature=1.0)),
    ],
)
def test_sampling_under_a_grammar_matches_the_constrained_target(target, monkeypatch, wrong, params):
    """The first emitted token follows the masked target distribution within sampling noise;
    a wrong implementation (the target's rows left unmasked, or the grammar-rejected draft
    token dropped so the row is drawn from the target instead of the residual) misses."""
    matcher, allowed, target_logits, draft_probs = _sampling_setup(target)
    if wrong is not None:
        monkeypatch.setattr(ConstrainedDraft, "for_verification", lambda self: (self.tokens, self.probs))
    if wrong == "drafts filtered, target rows not masked":
        monkeypatch.setattr(GrammarMatcher, "mask_logits", lambda self, logits, tokens, budget=None: logits)
    exact = logits_to_probs(target_logits[0].masked_fill(~allowed, float("-inf")), params)  # [V]
    trials = 4000
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(len(exact))
    for _ in range(trials):
        counts[_constrained_first_token(matcher, target_logits, draft_probs, params, gen)] += 1
    tv = 0.5 * float((counts / trials - exact).abs().sum())
    noise = 0.5 * float((2 * exact * (1 - exact) / (torch.pi * trials)).sqrt().sum())
    # noise: the expected TV of an exact sampler (see test_engine); the wrong ones land >10x
    assert tv < 2 * noise if wrong is None else tv > 5 * noise, (tv, noise)


def test_sampling_with_a_grammar_is_seeded_and_valid(target):
    engine = Engine(target, _model_drafter(target, seed=7), k=4)
    runs = [engine.generate(PROMPTS[0], max_new_tokens=80, temperature=0.9, seed=s, json_schema=TOOL,
                            chat=False)
            for s in (5, 5, 6)]
    assert runs[0].token_ids == runs[1].token_ids
    for run in runs:
        if run.finish_reason == "stop":
            assert json.loads(run.text)["name"] in ("search", "weather")


# ---- the matcher on its own ------------------------------------------------------------------


def test_masks_cover_padding_rows_and_eos(target):
    tok = target.tokenizer
    eos = tok.eos_token_id
    matcher = GrammarMatcher(grammar('start: "fox" | "fox dog"'), tok, {eos})
    ids = tok.encode("fox")
    vocab = len(tok) + 24  # the model's logits may have padding rows past the tokenizer's vocabulary
    masks = matcher.masks([0, *ids, eos], vocab)  # [2 + len(ids), V]
    assert masks.shape == (len(ids) + 2, vocab) and not masks[:, len(tok):].any()
    assert not masks[0, eos]  # "" is not a reply
    assert masks[len(ids), eos] and masks[len(ids)].sum() > 1  # after "fox": EOS, or go on to " dog"
    assert masks[-1].nonzero().flatten().tolist() == [eos]  # after EOS: never verified, EOS only
    assert matcher.history == [] and matcher.valid_prefix([*ids, eos, *ids]) == len(ids) + 1
    assert matcher.advance(tok.encode("fox")) is None and matcher.history == tok.encode("fox")
    matcher = GrammarMatcher(grammar('start: "fox" | "fox dog"'), tok, {eos})
    # stopped: EOS dropped
    assert matcher.advance([*tok.encode("fox dog"), eos]) == len(tok.encode("fox dog"))
    assert matcher.is_stopped and matcher.masks([0], vocab)[0].nonzero().flatten().tolist() == [eos]


@pytest.mark.parametrize(
    ("draft", "valid"),
    [('{"name": "search"', 6), ('{"name": "sea}', 7), ('{"name": "hello"', 4), ('{"query"', 1), ("hello", 0)],
)
def test_valid_prefix_table(target, draft, valid):
    tok = target.tokenizer
    matcher = GrammarMatcher(json_schema(TOOL), tok, target.eos_token_ids)
    tokens = tok.encode(draft)
    assert matcher.valid_prefix(tokens) == min(valid, len(tokens))
    assert matcher.history == [] and matcher.forced() == tok.encode('{"name": "')[:len(matcher.forced())]


# ---- requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"json_schema": {"type": "foo"}},
        {"json_schema": {"type": "string", "pattern": "("}},  # llguidance's message spans lines
        {"json_schema": {"not": {"type": "string"}}},  # unsupported keyword, strict
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"not": {}}, "strict": True}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "xml"}},
        {"response_format": "json"},
        {"response_format": {"type": "grammar", "grammar": "start: foo"}},
        {"response_format": {"type": "json_object"}, "json_schema": TOOL},
    ],
)
def test_bad_constraints_are_one_line_specdec_errors(target, kwargs):
    with pytest.raises(SpecdecError) as err:
        Engine(target, "none").generate("hi", max_new_tokens=4, **kwargs)
    assert err.value.param == "response_format" and "\n" not in str(err.value)


def test_response_format_shapes(target):
    assert constraint_from_response_format(None) is None
    assert constraint_from_response_format({"type": "text"}) is None
    assert constraint_from_response_format({"type": "json_object"}) == json_object()
    lenient = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}, "type": "object"}}}
    assert constraint_from_response_format(lenient).name == "x"  # not strict: unsupported keywords ignored
    engine = Engine(target, "ngram:min=1", k=4)
    result = engine.generate(PROMPTS[1], max_new_tokens=60, response_format={"type": "json_object"},
                             chat=False)
    assert result.text.startswith("{")
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text), dict)
    regex = engine.generate(PROMPTS[1], max_new_tokens=20,
                            response_format={"type": "regex", "regex": "(yes|no)"})
    assert regex.text in ("yes", "no") and regex.finish_reason == "stop"


# ---- the real model --------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "temperature_c": {"type": "integer"},
        "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
    },
    "required": ["city", "temperature_c", "conditions"],
    "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_real_model_json_reply_validates_and_equals_plain(smollm2, drafter):
    prompt = "Report the weather in Paris as JSON with city, temperature_c and conditions."
    spec = Engine(smollm2, drafter).generate(prompt, max_new_tokens=80, json_schema=WEATHER)
    plain = Engine(smollm2, "none", k=0).generate(prompt, max_new_tokens=80, json_schema=WEATHER)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "stop"
    reply = json.loads(spec.text)
    assert set(reply) == set(WEATHER["required"])
    assert isinstance(reply["city"], str) and isinstance(reply["temperature_c"], int)
    assert reply["conditions"] in WEATHER["properties"]["conditions"]["enum"]
    assert spec.stats.num_forced_tokens > 0


@pytest.mark.parametrize(("drafter", "k"), [("none", 0), ("ngram:min=1", 4)])
def test_rows_with_one_allowed_token_skip_the_lm_head(target, monkeypatch, drafter, k):
    """A row whose grammar mask allows one token is that token whatever its logits, so the
    forward skips its LM head (Backend.forward's `unscored`): the reply and its logprobs are
    those of scoring every row."""
    from specdec.backends.native.model.sequence import NativeSequence

    original, skipped = NativeSequence.forward, []

    def spy(score_all: bool):
        def forward(self, token_ids, unscored=()):
            skipped.append(0 if score_all else len(unscored))
            return original(self, token_ids, () if score_all else unscored)

        return forward

    ids = target.tokenizer.encode(PROMPTS[0])
    replies = []
    for score_all in (False, True):
        monkeypatch.setattr(NativeSequence, "forward", spy(score_all))
        engine = Engine(target, drafter, k=k, backend="native")
        replies.append(engine.generate(ids, max_new_tokens=MAX_NEW, json_schema=TOOL, logprobs=2))
    fast, full = replies
    assert fast.token_ids == full.token_ids and fast.logprobs == full.logprobs
    assert sum(skipped) > 0 and fast.stats.num_forced_tokens > 0  # rows were skipped
