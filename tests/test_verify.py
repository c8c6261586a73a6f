"""Verification: greedy tables, and the distribution-exactness of speculative sampling."""

from __future__ import annotations

import pytest
import torch

from specdec import verify
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.verify import verify_greedy, verify_sampling


@pytest.mark.parametrize(
    ("draft", "target_argmax", "accepted", "next_token"),
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # every draft accepted, then the bonus token
        ([1, 2, 3], [1, 5, 3, 4], 1, 5),  # rejected at position 1, recovered = target's choice
        ([1, 2, 3], [7, 2, 3, 4], 0, 7),  # rejected at once: still emits one token
        ([], [9], 0, 9),  # empty draft is plain decoding
    ],
)
def test_verify_greedy_table(draft, target_argmax, accepted, next_token):
    result = verify_greedy(torch.tensor(draft, dtype=torch.long), torch.tensor(target_argmax))
    assert (result.num_accepted, result.next_token) == (accepted, next_token)
    assert result.emitted(draft) == draft[:accepted] + [next_token]


VOCAB = 6
TARGET_LOGITS = torch.tensor(
    [[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 2.2, 0.0, 0.9]]
)  # [2, V]: distributions after the pending token and after the first draft token
DRAFT_PROBS = torch.tensor(
    [[0.05, 0.4, 0.3, 0.05, 0.1, 0.1], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]]
)  # [2, V]: a draft that disagrees with the target on purpose

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=4, top_p=0.9),
]


def _run_trials(target_probs, draft_probs, trials, seed=0, deterministic_draft=None):
    """Histogram of the first emitted token, and of the second when the first was accepted."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    for _ in range(trials):
        if deterministic_draft is None:
            draft = torch.multinomial(draft_probs[:1], 1, generator=gen).view(1)
            result = verify_sampling(draft, draft_probs[:1], target_probs, gen)
        else:
            draft = torch.tensor(deterministic_draft)
            result = verify_sampling(draft, None, target_probs, gen)
        tokens = result.emitted(draft.tolist())
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first / first.sum(), second / max(second.sum(), 1)


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


# With 12k trials over 6 outcomes the expected TV of an exact sampler is ~0.01; 0.03 leaves
# room for noise while every wrong residual below lands above 0.05.
TRIALS, BOUND = 12000, 0.03


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_sampling_matches_target_with_draft_probs(params):
    target_probs = logits_to_probs(TARGET_LOGITS, params)  # [2, V]
    draft_probs = DRAFT_PROBS.clone()
    first, second = _run_trials(target_probs, draft_probs, TRIALS)
    assert tv(first, target_probs[0]) < BOUND
    assert tv(second, target_probs[1]) < BOUND  # the bonus token is drawn from the target


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("draft_token", [0, 2])
def test_sampling_matches_target_with_one_hot_draft(params, draft_token):
    target_probs = logits_to_probs(TARGET_LOGITS, params)
    first, _ = _run_trials(target_probs, None, TRIALS, deterministic_draft=[draft_token])
    assert tv(first, target_probs[0]) < BOUND


@pytest.mark.parametrize(
    "wrong_residual",
    [
        lambda target, draft, token: target,  # resample from the target: over-weights the draft's mass
        lambda target, draft, token: (draft - target).clamp_min(0) / (draft - target).clamp_min(0).sum(),
    ],
    ids=["target-instead-of-residual", "reversed-residual"],
)
def test_the_bound_catches_a_wrong_residual(monkeypatch, wrong_residual):
    """The statistical test must be able to fail: a wrong residual breaks the bound."""
    monkeypatch.setattr(verify, "residual_distribution", wrong_residual)
    target_probs = logits_to_probs(TARGET_LOGITS, SamplingParams(temperature=1.0))
    first, _ = _run_trials(target_probs, DRAFT_PROBS.clone(), TRIALS)
    assert tv(first, target_probs[0]) > 0.05


def test_acceptance_rate_matches_theory():
    """P(accept) = sum_x min(target(x), draft(x)) (Leviathan et al., Lemma 3.3)."""
    target_probs = logits_to_probs(TARGET_LOGITS, SamplingParams(temperature=1.0))
    gen = torch.Generator().manual_seed(1)
    accepted = 0
    trials = 8000
    for _ in range(trials):
        draft = torch.multinomial(DRAFT_PROBS[:1], 1, generator=gen).view(1)
        accepted += verify_sampling(draft, DRAFT_PROBS[:1], target_probs, gen).num_accepted
    expected = float(torch.minimum(target_probs[0], DRAFT_PROBS[0]).sum())
    assert abs(accepted / trials - expected) < 0.02


def test_deterministic_when_seeded():
    target_probs = logits_to_probs(TARGET_LOGITS, SamplingParams(temperature=1.0))
    draft = torch.tensor([1])
    runs = [
        [verify_sampling(draft, DRAFT_PROBS[:1], target_probs, torch.Generator().manual_seed(s))
         for s in range(20)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
