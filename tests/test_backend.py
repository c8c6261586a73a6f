"""Rollback is a tested capability of every backend: a forward after rollback equals a fresh one."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from specdec.backends import make_backend
from specdec.backends import prefix_cache as backend_mod
from specdec.backends.hf import HFBackend
from specdec.errors import SpecdecError

BACKEND_KINDS = ["hf"]


@pytest.mark.parametrize("kind", BACKEND_KINDS)
@pytest.mark.parametrize(("prefix", "junk", "keep"), [(7, 5, 3), (12, 1, 0), (1, 8, 8), (5, 4, 4)])
def test_forward_after_rollback_equals_fresh_forward(kind, prefix, junk, keep):
    target = tiny_llama(seed=0)
    tokens = torch.randint(5, 300, (prefix + junk + 6,), generator=torch.Generator().manual_seed(prefix)).tolist()
    tail = tokens[prefix + junk :]

    rolled = make_backend(kind, target)
    rolled.prefill(tokens[:prefix])
    rolled.forward(tokens[prefix : prefix + junk])  # tokens that will be rejected
    rolled.rollback(prefix + keep)
    assert rolled.length == prefix + keep
    kept = tokens[prefix : prefix + keep]
    after = rolled.forward(tail)

    fresh = make_backend(kind, target)
    fresh.prefill(tokens[:prefix] + kept)
    expected = fresh.forward(tail)
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)


def test_chunked_forward_equals_one_pass():
    target = tiny_llama(seed=0)
    tokens = list(range(10, 30))
    one = HFBackend(target.model).prefill(tokens)
    chunked = HFBackend(target.model)
    chunked.prefill(tokens[:9])
    rows = torch.cat([chunked.forward(tokens[9:12]), chunked.forward(tokens[12:])])
    torch.testing.assert_close(rows, one[9:], rtol=1e-4, atol=1e-4)


def test_rollback_rejects_bad_lengths():
    backend = HFBackend(tiny_llama(seed=0).model)
    backend.prefill([1, 2, 3])
    with pytest.raises(ValueError):
        backend.rollback(4)
    with pytest.raises(ValueError):
        backend.rollback(-1)


def test_context_overflow_is_refused():
    backend = HFBackend(tiny_llama(seed=0, max_positions=16).model)
    backend.prefill(list(range(10)))
    with pytest.raises(ValueError, match="context overflow"):
        backend.forward(list(range(7)))


def test_unknown_backend():
    with pytest.raises(SpecdecError, match="unknown backend"):
        make_backend("tpu", tiny_llama(seed=0))


# ---- prefix caching: a prompt that starts like the last one keeps the cached part --------

PREFIX_BACKENDS = [("hf", {}), ("native", {"precision": "fp32"}), ("native", {"precision": "int4"})]
PREFIX_IDS = ["hf", "native-fp32", "native-int4"]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(backend_mod, "PREFILL_CHUNK", 4)


@pytest.mark.parametrize(("kind", "options"), PREFIX_BACKENDS, ids=PREFIX_IDS)
@pytest.mark.parametrize(
    ("shared", "decoded", "expect_keep"),
    [
        (10, 0, 8),  # a longer prompt that extends the last one: kept up to a chunk boundary
        (10, 6, 8),  # decoded tokens after the prompt are never reused
        (4, 3, 4),  # the prompts diverge after 4 tokens
        (3, 2, 0),  # less than a chunk in common
    ],
)
def test_prefill_keeping_a_cached_prefix_changes_no_bits(small_chunks, kind, options, shared, decoded, expect_keep):
    target = tiny_llama(seed=0)
    first = torch.randint(5, 300, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    second = first[:shared] + [301 + i for i in range(9)]  # diverges at `shared`
    backend = make_backend(kind, target, **options)
    backend.prefill(first)
    backend.forward(list(range(40, 40 + decoded)))  # a decoded answer
    keep = backend.cached_prefix(second)
    assert keep == expect_keep
    rows = backend.prefill(second, keep=keep)  # [len(second) - keep, V]
    assert backend.length == len(second) and rows.shape[0] == len(second) - keep
    cold = make_backend(kind, target, **options)
    assert torch.equal(rows, cold.prefill(second)[keep:])
    assert torch.equal(backend.forward([7, 8, 9]), cold.forward([7, 8, 9]))  # the decode after it too


def test_prefill_chunks_are_cut_at_fixed_positions(small_chunks):
    assert backend_mod.prefill_chunks(list(range(10)), 0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert backend_mod.prefill_chunks(list(range(6)), 6) == [[0, 1], [2, 3, 4, 5]]
    assert backend_mod.prefill_chunks([], 3) == []


@pytest.mark.parametrize(("kind", "options"), PREFIX_BACKENDS[:2], ids=PREFIX_IDS[:2])
def test_prefix_record_follows_rollback_reset_and_hidden_states(small_chunks, kind, options):
    backend = make_backend(kind, tiny_llama(seed=0), **options)
    prompt = list(range(10, 30))
    backend.prefill(prompt)
    assert backend.cached_prefix(prompt + [1]) == 20
    backend.rollback(15)  # below the prefilled length: those tokens are gone
    assert backend.cached_prefix(prompt) == 12
    with pytest.raises(ValueError, match="does not hold"):
        backend.prefill([99, *prompt[1:]], keep=4)
    assert backend.cached_prefix(prompt) == 0  # a refused prefill resets
    backend.prefill(prompt)
    backend.keep_hidden = True  # a drafter now reads hidden states the prefix did not keep
    assert backend.cached_prefix(prompt) == 0
    backend.prefill(prompt)
    assert backend.cached_prefix(prompt) == 20
    assert backend.hidden.shape[0] == 20
    backend.reset()
    assert backend.cached_prefix(prompt) == 0


@pytest.mark.parametrize(("kind", "options"), PREFIX_BACKENDS[:2], ids=PREFIX_IDS[:2])
@pytest.mark.parametrize(
    ("reuse_decoded", "extra", "shared", "expect_keep"),
    [
        (False, 0, 17, 8),  # prompt-only caching: the answer is not kept, the prompt to a chunk boundary
        (True, 0, 17, 17),  # decoded: prompt and answer, at any length
        (True, 0, 13, 13),  # ... or as much of the answer as the next prompt repeats
        (True, 0, 7, 4),  # a prompt that leaves before the answer: cold bits, on the chunk grid
        (True, 2, 17, 8),  # the cache holds two tokens past what was marked: the mark is refused
    ],
)
def test_mark_decoded_keeps_answers_only_when_asked(small_chunks, kind, options, reuse_decoded, extra, shared,
                                                    expect_keep):
    backend = make_backend(kind, tiny_llama(seed=0), **options)
    backend.reuse_decoded = reuse_decoded
    prompt, answer = list(range(10, 20)), list(range(50, 57))
    backend.prefill(prompt)
    backend.forward(answer + [99] * extra)
    backend.mark_decoded(prompt + answer)
    follow_up = (prompt + answer)[:shared] + [5, 6, 7]
    keep = backend.cached_prefix(follow_up)
    assert keep == expect_keep
    rows = backend.prefill(follow_up, keep=keep)
    assert rows.shape[0] == len(follow_up) - keep and backend.length == len(follow_up)
    if expect_keep % 4 == 0:  # kept on the grid: a cold prefill's bits
        cold = make_backend(kind, tiny_llama(seed=0), **options)
        assert torch.equal(rows, cold.prefill(follow_up)[keep:])
    if shared == 17 and reuse_decoded and not extra:
        backend.rollback(12)  # the record follows the cache
        assert backend.cached_prefix(follow_up) == 12
