"""Rollback is a tested capability of every backend: a forward after rollback equals a fresh one."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from specdec.backends import Backend, FeatureModel, RollbackLM, available, make_backend
from specdec.backends import prefix_cache as backend_mod
from specdec.backends.hf import HFBackend
from specdec.backends.prefix_cache import PrefixCache
from specdec.errors import SpecdecError

BACKEND_KINDS = ["hf"]


@pytest.mark.parametrize("kind", BACKEND_KINDS)
@pytest.mark.parametrize(("prefix", "junk", "keep"), [(7, 5, 3), (12, 1, 0), (1, 8, 8), (5, 4, 4)])
def test_forward_after_rollback_equals_fresh_forward(kind, prefix, junk, keep):
    target = tiny_llama(seed=0)
    tokens = torch.randint(5, 300, (prefix + junk + 6,),
                           generator=torch.Generator().manual_seed(prefix)).tolist()
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


# ---- the contract: every registered backend implements all of `Backend` ---------------------

CONTRACT_OPTIONS = {"hf": {}, "native": {"precision": "fp32"}, "auto": {}}  # a new backend adds its row here


def protocol_members(*protocols) -> set[str]:
    names = set()
    for proto in protocols:
        names |= set(proto.__annotations__)
        names |= {n for n in vars(proto) if not n.startswith("_")}
    return names


def test_the_contract_table_lists_every_registered_backend():
    assert set(CONTRACT_OPTIONS) == set(available())
    assert {"forward_tree", "keep", "supports_tree", "pool", "enable_hidden_states", "hidden",
            "compile_seconds", "prefix_cache", "prefill", "reset"} <= protocol_members(Backend)


@pytest.mark.parametrize("kind", sorted(CONTRACT_OPTIONS))
def test_every_backend_implements_the_whole_protocol(kind):
    backend = make_backend(kind, tiny_llama(seed=0), **CONTRACT_OPTIONS[kind])
    missing = sorted(m for m in protocol_members(Backend, RollbackLM) if not hasattr(backend, m))
    assert not missing, f"{kind} lacks {missing}"
    assert isinstance(backend, Backend) and isinstance(backend.prefix_cache, PrefixCache)
    assert isinstance(backend.supports_tree, bool) and backend.compile_seconds == 0.0
    assert backend.pool is None or backend.pool.free_slots >= 0
    assert backend.hidden is None
    backend.enable_hidden_states()
    backend.prefill([5, 6, 7])
    assert backend.length == 3 and backend.hidden.shape[0] == 3  # [length, H]
    if backend.supports_tree:
        assert backend.forward_tree([8, 9, 10], [-1, 0, -1]).shape[0] == 3  # [T, V]
        backend.keep([0, 1])
        assert backend.length == 5 and backend.hidden.shape[0] == 5
    features = backend.feature_model()
    missing = sorted(m for m in protocol_members(FeatureModel) if not hasattr(features, m))
    assert not missing, f"{kind}'s feature model lacks {missing}"
    assert features == backend.feature_model()  # a drafter builds its head once per model
    assert features.embed(torch.tensor([5, 6])).shape == (2, features.hidden_size)
    assert features.logits(backend.hidden[:2]).shape == (2, features.vocab_size)
    backend.reset()
    assert backend.length == 0


@pytest.mark.parametrize("kind", sorted(CONTRACT_OPTIONS))
def test_unknown_options_are_one_line_errors(kind):
    target = tiny_llama(seed=0)
    with pytest.raises(SpecdecError, match="colour") as info:
        make_backend(kind, target, colour="blue")
    assert "\n" not in str(info.value)
    with pytest.raises(SpecdecError, match="prefix_cache must be one of"):
        make_backend(kind, target, prefix_cache="everything")


@pytest.mark.parametrize("kind", sorted(CONTRACT_OPTIONS))
def test_prefix_cache_off_keeps_nothing(kind):
    backend = make_backend(kind, tiny_llama(seed=0), prefix_cache="off", **CONTRACT_OPTIONS[kind])
    prompt = list(range(10, 200))  # past one PREFILL_CHUNK
    backend.prefill(prompt)
    assert backend.prefix_cache.mode == "off" and backend.prefix_cache.cached_prefix(prompt) == 0


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
def test_prefill_keeping_a_cached_prefix_changes_no_bits(small_chunks, kind, options, shared, decoded,
                                                         expect_keep):
    target = tiny_llama(seed=0)
    first = torch.randint(5, 300, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    second = first[:shared] + [301 + i for i in range(9)]  # diverges at `shared`
    backend = make_backend(kind, target, **options)
    backend.prefill(first)
    backend.forward(list(range(40, 40 + decoded)))  # a decoded answer
    keep = backend.prefix_cache.cached_prefix(second)
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


@pytest.mark.parametrize(("sizes", "group_tokens", "groups"), [
    # one chunk a call (hf, and native where GEMM rows depend on M)
    ([2, 4, 4, 1], None, [[2], [4], [4], [1]]),
    ([2, 4, 4, 1], 8, [[2, 4], [4, 1]]),
    ([4, 4, 4], 4, [[4], [4], [4]]),
    ([4, 4, 4], 100, [[4, 4, 4]]),
])
def test_chunk_groups_take_consecutive_chunks_up_to_a_token_count(sizes, group_tokens, groups):
    chunks = [list(range(n)) for n in sizes]
    got = backend_mod.chunk_groups(chunks, group_tokens)
    assert [[len(c) for c in group] for group in got] == groups
    assert [c for group in got for c in group] == chunks


@pytest.mark.parametrize(("kind", "options"), PREFIX_BACKENDS[:2], ids=PREFIX_IDS[:2])
def test_prefix_record_follows_rollback_reset_and_hidden_states(small_chunks, kind, options):
    backend = make_backend(kind, tiny_llama(seed=0), **options)
    prompt = list(range(10, 30))
    backend.prefill(prompt)
    assert backend.prefix_cache.cached_prefix(prompt + [1]) == 20
    backend.rollback(15)  # below the prefilled length: those tokens are gone
    assert backend.prefix_cache.cached_prefix(prompt) == 12
    with pytest.raises(ValueError, match="does not hold"):
        backend.prefill([99, *prompt[1:]], keep=4)
    assert backend.prefix_cache.cached_prefix(prompt) == 0  # a refused prefill resets
    backend.prefill(prompt)
    backend.enable_hidden_states()  # a drafter now reads hidden states the prefix did not keep
    assert backend.prefix_cache.cached_prefix(prompt) == 0
    backend.prefill(prompt)
    assert backend.prefix_cache.cached_prefix(prompt) == 20
    assert backend.hidden.shape[0] == 20
    backend.reset()
    assert backend.prefix_cache.cached_prefix(prompt) == 0


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
    backend = make_backend(kind, tiny_llama(seed=0), prefix_cache="decoded" if reuse_decoded else "prompt",
                           **options)
    prompt, answer = list(range(10, 20)), list(range(50, 57))
    backend.prefill(prompt)
    backend.forward(answer + [99] * extra)
    backend.prefix_cache.mark_decoded(prompt + answer, backend.length)
    follow_up = (prompt + answer)[:shared] + [5, 6, 7]
    keep = backend.prefix_cache.cached_prefix(follow_up)
    assert keep == expect_keep
    rows = backend.prefill(follow_up, keep=keep)
    assert rows.shape[0] == len(follow_up) - keep and backend.length == len(follow_up)
    if expect_keep % 4 == 0:  # kept on the grid: a cold prefill's bits
        cold = make_backend(kind, tiny_llama(seed=0), **options)
        assert torch.equal(rows, cold.prefill(follow_up)[keep:])
    if shared == 17 and reuse_decoded and not extra:
        backend.rollback(12)  # the record follows the cache
        assert backend.prefix_cache.cached_prefix(follow_up) == 12
