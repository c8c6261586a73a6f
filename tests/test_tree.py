"""Token trees: helpers, greedy and sampling tree verification, and tree scoring on HFBackend."""

from __future__ import annotations

import pytest
import torch

from specdec import tree
from specdec.backends.hf import HFBackend
from specdec.drafters import Draft
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.tree import (
    ancestor_mask,
    check_tree,
    first_path,
    fit_tree,
    prune_tree,
    subtree,
    tree_children,
    tree_depths,
    tree_path,
    verify_tree_greedy,
    verify_tree_sampling,
)

# pending ─┬─ 5 ─┬─ 6
#          │     └─ 9 ── 4
#          └─ 7
TOKENS = [5, 7, 6, 9, 4]
PARENTS = [-1, -1, 0, 0, 3]


def test_tree_helpers():
    assert tree_depths(PARENTS) == [0, 0, 1, 1, 2]
    assert tree_children(PARENTS) == [[2, 3], [], [], [4], [], [0, 1]]  # last entry: the roots
    assert tree_path(PARENTS, 4) == [0, 3, 4]
    assert first_path(PARENTS) == [0, 2]
    mask = ancestor_mask(PARENTS)
    assert mask[4].tolist() == [True, False, False, True, True]
    assert mask[1].tolist() == [False, True, False, False, False]
    assert prune_tree(PARENTS, max_depth=2, max_nodes=10) == [0, 1, 2, 3]
    assert prune_tree(PARENTS, max_depth=3, max_nodes=3) == [0, 1, 2]
    assert subtree(TOKENS, PARENTS, [0, 3, 4]) == ([5, 9, 4], [-1, 0, 1])
    with pytest.raises(ValueError, match="parent must come before"):
        check_tree([-1, 2, 0])


def test_fit_tree_cuts_or_flattens():
    draft = Draft(TOKENS, None, PARENTS)
    cut = fit_tree(draft, max_depth=2, max_nodes=3, use_tree=True)
    assert (cut.tokens, cut.parents) == ([5, 7, 6], [-1, -1, 0])
    chain = fit_tree(draft, max_depth=5, max_nodes=5, use_tree=False)
    assert (chain.tokens, chain.parents) == ([5, 6], None)  # the best chain, as a chain


@pytest.mark.parametrize(
    ("argmax", "accepted", "next_token"),
    [
        ([5, 9, 0, 0, 4, 8], [0, 3, 4], 8),  # the deepest path, then the bonus token
        ([5, 6, 0, 0, 0, 0], [0, 2], 0),  # first branch all the way
        ([7, 0, 3, 0, 0, 0], [1], 3),  # the second root; its row gives the next token
        ([5, 1, 0, 0, 0, 0], [0], 1),  # node 0 accepted, none of its children
        ([2, 0, 0, 0, 0, 0], [], 2),  # no root matches: plain decoding
    ],
)
def test_verify_tree_greedy_table(argmax, accepted, next_token):
    result = verify_tree_greedy(TOKENS, PARENTS, torch.tensor(argmax))
    assert (result.accepted, result.next_token) == (accepted, next_token)
    assert result.emitted(TOKENS) == [TOKENS[i] for i in accepted] + [next_token]


# ---- sampling: the first two emitted tokens must follow the target's joint distribution ----

V = 5
FIRST_LOGITS = torch.tensor([0.9, 0.6, 0.3, 0.0, -0.4])  # [V] target after the pending token
NEXT_LOGITS = torch.tensor(
    [
        [0.2, 1.1, -0.3, 0.5, 0.0],
        [1.0, -0.5, 0.4, 0.0, 0.8],
        [-0.2, 0.3, 0.9, 0.6, 0.1],
        [0.5, 0.5, -1.0, 1.2, 0.0],
        [0.0, -0.3, 0.2, 0.4, 1.0],
    ]
)  # [V, V] target after (pending, x1), row x1
DRAFT_FIRST = torch.tensor([0.1, 0.2, 0.4, 0.2, 0.1])  # [V] draft's distribution for roots
DRAFT_NEXT = torch.tensor(
    [
        [0.5, 0.1, 0.1, 0.2, 0.1],
        [0.2, 0.2, 0.2, 0.2, 0.2],
        [0.1, 0.1, 0.1, 0.1, 0.6],
        [0.3, 0.3, 0.1, 0.1, 0.2],
        [0.25, 0.25, 0.25, 0.15, 0.1],
    ]
)  # [V, V] draft's distribution for children, row = parent token

# Three sibling roots, the first two with children: siblings of both levels get rejected.
FIXED_TOKENS = [0, 1, 2, 1, 3, 0]
FIXED_PARENTS = [-1, -1, -1, 0, 0, 1]
SAMPLED_PARENTS = [-1, -1, 0, 0, 1]  # two roots drawn from DRAFT_FIRST, children from DRAFT_NEXT
TRIALS = 6000
# An exact sampler's joint TV over the 25 (x1, x2) cells is 0.02-0.04 at this size (measured
# over seeds); every wrong residual below lands near 0.2.
BOUND = 0.06


def _joint(params, sampled_draft, trials=TRIALS, seed=0):
    """Empirical joint [V, V] of the first two emitted tokens over many verified trees."""
    gen = torch.Generator().manual_seed(seed)
    next_probs = logits_to_probs(NEXT_LOGITS, params)  # [V, V]
    target_rows = torch.cat([logits_to_probs(FIRST_LOGITS, params)[None], next_probs])  # [1+V, V]
    draft_rows = torch.cat([DRAFT_FIRST[None], DRAFT_NEXT])  # [1+V, V]
    # Draws that do not depend on verification are made up front, in batches.
    roots = torch.multinomial(DRAFT_FIRST, 2 * trials, replacement=True, generator=gen).view(trials, 2)
    kids = torch.multinomial(DRAFT_NEXT, 3 * trials, replacement=True, generator=gen).view(V, trials, 3)
    # When a step emits one token, the next step samples x2 from the target: [V, trials].
    fallback = torch.multinomial(next_probs, trials, replacement=True, generator=gen).tolist()
    counts = [[0] * V for _ in range(V)]
    for trial in range(trials):
        if sampled_draft:
            r0, r1 = roots[trial].tolist()
            tokens = [r0, r1, int(kids[r0, trial, 0]), int(kids[r0, trial, 1]), int(kids[r1, trial, 2])]
            parents = SAMPLED_PARENTS
            draft_probs = draft_rows[[0, 0, r0 + 1, r0 + 1, r1 + 1]]  # [5, V]
        else:
            tokens, parents, draft_probs = FIXED_TOKENS, FIXED_PARENTS, None
        # Row 0 is after the pending token, row i+1 after node i (deeper nodes reuse NEXT rows).
        target_probs = target_rows[[0, *[t + 1 for t in tokens]]]  # [n+1, V]
        emitted = verify_tree_sampling(tokens, parents, draft_probs, target_probs, gen).emitted(tokens)
        first = emitted[0]
        second = emitted[1] if len(emitted) > 1 else fallback[first][trial]
        counts[first][second] += 1
    return torch.tensor(counts, dtype=torch.float) / trials


def _exact_joint(params):
    first = logits_to_probs(FIRST_LOGITS, params)  # [V]
    return first[:, None] * logits_to_probs(NEXT_LOGITS, params)  # [V, V]


def _tv(a, b):
    return 0.5 * float((a - b).abs().sum())


CASES = [
    (SamplingParams(temperature=1.0), False),
    (SamplingParams(temperature=1.0), True),
    (SamplingParams(temperature=0.8, top_k=4), True),
]


@pytest.mark.parametrize(("params", "sampled_draft"), CASES, ids=["fixed", "sampled", "sampled-topk"])
def test_tree_sampling_matches_target(params, sampled_draft):
    joint = _joint(params, sampled_draft)
    exact = _exact_joint(params)
    assert _tv(joint, exact) < BOUND
    assert float(joint[exact == 0].sum()) == 0.0  # never a token the target excludes


def _keep_target(target_probs, draft_probs, draft_token):
    return target_probs  # wrong: a rejected sibling stays in the distribution


def _drop_token_only(target_probs, draft_probs, draft_token):
    residual = target_probs.clone()  # wrong for sampled siblings: ignores their distribution
    residual[draft_token] = 0.0
    return residual / residual.sum()


# A deterministic tree takes no residual (it accepts the child equal to the target's own
# sample); wrong variants of that path are caught in test_seeded_sampling.py.
@pytest.mark.parametrize(
    ("wrong", "sampled_draft"), [(_keep_target, True), (_drop_token_only, True)]
)
def test_wrong_residual_breaks_the_bound(monkeypatch, wrong, sampled_draft):
    """The bound is tight enough to catch a verifier that mishandles rejected siblings."""
    monkeypatch.setattr(tree, "residual_distribution", wrong)
    params = SamplingParams(temperature=1.0)
    assert _tv(_joint(params, sampled_draft, trials=2000), _exact_joint(params)) > 2 * BOUND


def test_tree_sampling_greedy_params_follow_argmax():
    params = SamplingParams()  # one-hot target distributions
    rows = torch.cat([FIRST_LOGITS[None], NEXT_LOGITS[FIXED_TOKENS]])  # [n+1, V]
    target_probs = logits_to_probs(rows, params)
    result = verify_tree_sampling(FIXED_TOKENS, FIXED_PARENTS, None, target_probs,
                                  torch.Generator().manual_seed(0))
    greedy = verify_tree_greedy(FIXED_TOKENS, FIXED_PARENTS, target_probs.argmax(-1))
    assert (result.accepted, result.next_token) == (greedy.accepted, greedy.next_token)


# ---- HFBackend: tree scoring equals scoring each path as a chain ----------------------------


def test_hf_forward_tree_matches_chains_and_keep_compacts():
    from conftest import tiny_llama

    model = tiny_llama(seed=1).model
    context = [5, 17, 33, 2, 99, 41, 7]
    tokens, parents = [10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, -1, 4]
    backend = HFBackend(model)
    assert backend.supports_tree
    backend.prefill(context)
    logits = backend.forward_tree(tokens, parents)  # [6, V]
    chain = HFBackend(model)
    for i in range(len(tokens)):
        chain.prefill(context)
        path_logits = chain.forward([tokens[j] for j in tree_path(parents, i)])
        torch.testing.assert_close(logits[i], path_logits[-1], atol=1e-4, rtol=1e-4)
    backend.keep([0, 1, 3])  # the path 10 -> 11 -> 13
    assert backend.length == len(context) + 3
    after = backend.forward([20, 21])
    chain.prefill(context)
    expected = chain.forward([10, 11, 13, 20, 21])[-2:]
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_hf_forward_tree_on_the_embedded_model(smollm2):
    backend, chain = HFBackend(smollm2.model), HFBackend(smollm2.model)
    assert backend.supports_tree
    context = smollm2.tokenizer.encode('{"name": "get_weather", "arguments": {"city": "')
    tokens = smollm2.tokenizer.encode("Oslo Paris Rome", add_special_tokens=False)[:3]
    parents = [-1, -1, 1]
    backend.prefill(context)
    logits = backend.forward_tree(tokens, parents)  # [3, V]
    for i in range(len(tokens)):
        chain.prefill(context)
        expected = chain.forward([tokens[j] for j in tree_path(parents, i)])[-1]
        torch.testing.assert_close(logits[i], expected, atol=2e-3, rtol=1e-3)
        assert int(logits[i].argmax()) == int(expected.argmax())
