"""Seeded sampling does not depend on k (issue 16, fault 8).

The verifier's random draws are keyed to the output position (sampling.PositionDraws), and a
deterministic draft is accepted exactly when it equals the target's own sample there. So one
seed gives one reply whatever k the load policy picks, token for token the reply of seeded
plain decoding; and the replies are still distributed exactly as the target's samples.
"""

from __future__ import annotations

import pytest
import torch

import specdec.sequence as sequence_mod
from conftest import spy_trees, tiny_llama
from specdec import verify
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.request import Prepared
from specdec.sampling import PositionDraws, SamplingParams, logits_to_probs, sample_at
from specdec.serve.scheduler import GenRequest, LoadPolicy, Scheduler
from specdec.tree import verify_tree_sampling
from specdec.verify import VerifyResult, verify_sampling

# ---- the draws --------------------------------------------------------------------------------


def test_draws_depend_on_seed_and_position_only():
    a, b = PositionDraws(7), PositionDraws(7)
    assert torch.equal(a.exponentials(3, 50), b.exponentials(3, 50))
    assert torch.equal(a.uniforms(3, 4), b.uniforms(3, 4))
    assert not torch.equal(a.exponentials(3, 50), a.exponentials(4, 50))
    assert not torch.equal(a.exponentials(3, 50), PositionDraws(8).exponentials(3, 50))
    # the uniforms of soft drafts are a stream of their own, not the sampling noise
    assert not torch.equal(a.uniforms(3, 50), torch.exp(-a.exponentials(3, 50)))
    assert torch.equal(PositionDraws(-1).exponentials(0, 5), PositionDraws(2**64 - 1).exponentials(0, 5))


def test_sample_at_draws_from_probs():
    probs = logits_to_probs(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3]),
                            SamplingParams(1.0, top_k=4))  # [6]
    trials = 12000
    counts = torch.zeros(6)
    for i in range(trials):
        counts[sample_at(probs, PositionDraws(i // 100), i % 100)] += 1
    assert counts[probs == 0].sum() == 0  # never a token top-k removed
    assert 0.5 * float((counts / trials - probs).abs().sum()) < 0.02  # an exact sampler: ~0.008


# ---- verification on a tiny model's distributions ---------------------------------------------

V = 8
PROMPT = [5, 1, 2]


@pytest.fixture(scope="module")
def tiny_rows():
    """The tiny model's logits after the prompt [V] and after the prompt plus each token [V, V]."""
    model = tiny_llama(seed=3, vocab=V).model
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1]
        second = model(torch.tensor([PROMPT + [t] for t in range(V)])).logits[:, -1]
    return first, second


def _probs(tiny_rows, params):
    first, second = tiny_rows
    return logits_to_probs(first, params), logits_to_probs(second, params)  # [V], [V, V]


def _row(first, second, prefix: list[int]) -> torch.Tensor:
    return first if not prefix else second[prefix[0]]


def _greedy_draft(first, second, prefix: list[int], k: int) -> list[int]:
    """A deterministic drafter: the target's own argmax chain (a greedy draft model)."""
    draft: list[int] = []
    while len(draft) < k and len(prefix) + len(draft) < 2:
        draft.append(int(_row(first, second, prefix + draft).argmax()))
    return draft


def _two_tokens(first, second, k: int, draws, keyed_by_step: bool = False) -> tuple[list[int], int]:
    """Two tokens the engine's way: each step drafts up to k (at most the tokens left - 1),
    verifies at the output position where it starts; returns (tokens, accepted drafts)."""
    out: list[int] = []
    accepted = 0
    while len(out) < 2:
        draft = _greedy_draft(first, second, out, min(k, 1 - len(out)))
        rows = torch.stack([_row(first, second, out + draft[:i]) for i in range(len(draft) + 1)])  # [k+1, V]
        position = 0 if keyed_by_step else len(out)  # the bug: draws keyed by the index in the step
        result = verify_sampling(torch.tensor(draft, dtype=torch.long), None, rows, draws, position)
        accepted += result.num_accepted
        out += result.emitted(draft)
    return out[:2], accepted


def _joint_tv(first, second, k: int, trials: int, **kw) -> tuple[float, float, int]:
    """(TV of the empirical joint of two tokens from the exact one, an exact sampler's expected
    TV at this size, accepted drafts)."""
    exact = first[:, None] * second  # [V, V]
    counts = torch.zeros(V, V)
    accepted = 0
    for seed in range(trials):
        (a, b), n = _two_tokens(first, second, k, PositionDraws(seed), **kw)
        counts[a, b] += 1
        accepted += n
    tv = 0.5 * float((counts / trials - exact).abs().sum())
    # E|p̂ - p| ≈ sqrt(2 p (1 - p) / (pi N)) per cell
    noise = 0.5 * float((2 * exact * (1 - exact) / (torch.pi * trials)).sqrt().sum())
    return tv, noise, accepted


TRIALS = 4000
PARAMS = [SamplingParams(1.0), SamplingParams(0.8, top_k=5)]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_position_keyed_speculative_sampling_matches_the_target(tiny_rows, params):
    first, second = _probs(tiny_rows, params)
    tv, noise, accepted = _joint_tv(first, second, 1, TRIALS)
    assert 0 < accepted < TRIALS  # drafts were accepted, and rejected
    assert tv < 2 * noise, (tv, noise)


def _accept_in_top_two(draft_tokens, target_probs, draws, position):
    """Wrong: accepts a draft token that is among the two best of the position's race."""
    k = len(draft_tokens)
    for n, drafted in enumerate(draft_tokens):
        race = target_probs[n] / draws.exponentials(position + n, target_probs.shape[-1])
        top = race.topk(2).indices.tolist()
        if drafted not in top:
            return VerifyResult(n, top[0], k)
    return VerifyResult(k, sample_at(target_probs[k], draws, position + k), k)


def test_wrong_variants_break_the_bound(tiny_rows, monkeypatch):
    """The bound can fail: noise keyed by the index within the step (so a later step reuses
    a position's noise), or accepting a draft in the top two, land far above it."""
    first, second = _probs(tiny_rows, PARAMS[0])
    tv, noise, _ = _joint_tv(first, second, 1, TRIALS // 2, keyed_by_step=True)
    assert tv > 4 * noise, (tv, noise)
    monkeypatch.setattr(verify, "_verify_one_hot", _accept_in_top_two)
    tv, noise, _ = _joint_tv(first, second, 1, TRIALS // 2)
    assert tv > 4 * noise, (tv, noise)


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_soft_drafts_keep_the_residual_with_position_keyed_draws(tiny_rows, params):
    """A sampled draft (its distribution known) is accepted with min(1, p/q) on the
    position's uniform and resampled from the residual with the position's noise: exact."""
    first, second = _probs(tiny_rows, params)
    draft_probs = torch.linspace(1.0, 3.0, V).softmax(-1)  # [V], far from the target on purpose
    drafted = torch.multinomial(draft_probs, 6000, replacement=True,
                                generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(V)
    accepted = 0
    for seed, token in enumerate(drafted.tolist()):
        rows = torch.stack([first, second[token]])  # [2, V]
        result = verify_sampling(torch.tensor([token]), draft_probs[None], rows, PositionDraws(seed),
                                 seed % 5)
        counts[result.emitted([token])[0]] += 1
        accepted += result.num_accepted
    assert 0 < accepted < len(drafted)
    assert 0.5 * float((counts / len(drafted) - first).abs().sum()) < 0.03  # an exact sampler: ~0.01


# A tree below the pending token: roots 4, 6, 7; 4 and 7 have children.
TREE_TOKENS = [4, 6, 7, 1, 6, 4]
TREE_PARENTS = [-1, -1, -1, 0, 0, 2]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_chain_and_tree_verification_emit_the_plain_samples(tiny_rows, params):
    """With one seed, a verified chain or tree emits what plain sampling draws at the same
    output positions, token for token, wherever the step starts. (The rows make a Markov
    chain, each the tiny model's distribution after the last token.)"""
    first, second = _probs(tiny_rows, params)
    accepted = 0
    for seed in range(300):
        draws, start = PositionDraws(seed), seed % 5  # the step's first output position
        plain = [sample_at(first, draws, start)]  # rows as a Markov chain: each after the last token
        for i in (1, 2):
            plain.append(sample_at(second[plain[-1]], draws, start + i))
        chain = _greedy_draft(first, second, [], 2)[:1]
        rows = torch.stack([first, second[chain[0]]])  # [2, V]
        result = verify_sampling(torch.tensor(chain), None, rows, draws, start)
        assert result.emitted(chain) == plain[: len(result.emitted(chain))]
        tree_rows = torch.cat([first[None], second[TREE_TOKENS]])  # [n+1, V]
        tree = verify_tree_sampling(TREE_TOKENS, TREE_PARENTS, None, tree_rows, draws, start)
        assert tree.emitted(TREE_TOKENS) == plain[: len(tree.emitted(TREE_TOKENS))]
        accepted += result.num_accepted + tree.num_accepted
    assert accepted > 100


# ---- through the engine and the scheduler -----------------------------------------------------

CODE = "def add(a, b):\n    return a + b\ndef add(a, b):\n    return"
# suffix:global=0: the process-wide trie of earlier requests (other tests' too) would make the
# drafts depend on the order the suite runs in
SCHEDULES = [("ngram:min=1", 1), ("ngram:min=1", 4), ("ngram:min=1", "auto"), ("suffix:global=0", "auto"),
             ("suffix:tree=1:global=0", 4)]
TEMPERATURE, MAX_NEW = 0.3, 64


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def _reply(target, drafter, k, seed, trees=None):
    engine = Engine(target, drafter=drafter, k=k)
    if trees is not None:
        trees.append(spy_trees(engine.backend))  # filled as the engine scores trees
    ids = target.tokenizer.encode(CODE)
    return engine.generate(ids, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=seed)


@pytest.mark.parametrize("seed", [2, 3])
def test_one_seed_one_reply_whatever_k(target, seed):
    """ngram and suffix under k = 1, 4 and adaptive give seeded plain sampling's reply."""
    plain = _reply(target, "none", 0, seed).token_ids
    greedy = Engine(target, drafter="none", k=0).generate(target.tokenizer.encode(CODE),
                                                          max_new_tokens=MAX_NEW)
    assert plain != greedy.token_ids  # it samples
    trees: list[list[list[int]]] = []
    for drafter, k in SCHEDULES:
        result = _reply(target, drafter, k, seed, trees)
        assert result.token_ids == plain, (drafter, k)
        assert result.stats.num_draft_tokens > result.stats.num_accepted_tokens > 0, (drafter, k)
    assert any(trees)  # the suffix drafter's trees went through tree verification


def _draws_in_turn(draft_tokens, draft_probs, target_probs, generator, position):
    """The sampler before the fix: k uniforms, then the next token, from one generator."""
    k = draft_tokens.shape[0]
    accept = target_probs[torch.arange(k), draft_tokens]  # [k], one-hot drafts
    rejected = (torch.rand(k, generator=generator) >= accept).nonzero()
    n = int(rejected[0, 0]) if rejected.numel() else k
    row = target_probs[n].clone()
    if n < k:
        row[draft_tokens[n]] = 0.0
    return VerifyResult(n, int(torch.multinomial(row, 1, generator=generator)), k)


def test_draws_taken_in_turn_depend_on_k(target, monkeypatch):
    """The faulty sampler fails the test above: its reply changes with k."""
    monkeypatch.setattr(sequence_mod, "PositionDraws", lambda seed: torch.Generator().manual_seed(seed))
    monkeypatch.setattr(sequence_mod, "verify_sampling", _draws_in_turn)
    replies = [_reply(target, "ngram:min=1", k, 2).token_ids for k in (1, 4)]
    assert replies[0] != replies[1]


class Collect:
    def __init__(self):
        self.result = None

    def __call__(self, kind, payload):
        if kind == "error":
            raise payload
        if kind == "done":
            self.result = payload


def _serve(sched: Scheduler, requests: list[GenRequest]) -> None:
    for req in requests:
        sched.submit(req)
    for _ in range(5000):
        if not sched.step() and not sched.queue_depth:
            return
    raise AssertionError("the scheduler did not drain")


def test_same_seed_same_reply_under_load(target):
    """Alone a request drafts up to 4 tokens a step; among 4 requests the load policy caps
    k at 1 (8 // 4 - 1), then lets it grow as the others leave. Same seed, same reply."""
    params = SamplingParams(temperature=TEMPERATURE)
    ids = target.tokenizer.encode(CODE)
    sched = Scheduler(target, EngineConfig(drafter="ngram:min=1", k=4), max_batch=4,
                      policy=LoadPolicy(max_batch_tokens=8))
    alone = Collect()
    _serve(sched, [GenRequest(Prepared.tokens(list(ids), params, MAX_NEW, seed=3), alone)])
    busy = [Collect() for _ in range(4)]
    others = ["The quick brown fox jumps over the lazy dog. The", "| name | value |\n| a |", "The lazy dog"]
    _serve(sched, [GenRequest(Prepared.tokens(list(ids), params, MAX_NEW, seed=3), busy[0])]
           + [GenRequest(Prepared.tokens(target.tokenizer.encode(p), params, MAX_NEW, seed=i), c)
              for i, (p, c) in enumerate(zip(others, busy[1:], strict=True))])
    want = Engine(target, drafter="none", k=0).generate(ids, max_new_tokens=MAX_NEW, temperature=TEMPERATURE,
                                                        seed=3)
    assert alone.result.token_ids == busy[0].result.token_ids == want.token_ids
    assert alone.result.stats.num_accepted_tokens > 0 and busy[0].result.stats.num_accepted_tokens > 0
    assert alone.result.stats.num_draft_tokens != busy[0].result.stats.num_draft_tokens  # k differed
