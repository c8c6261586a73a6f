"""The batch-invariant attention routine (backends/native/attention.py): a query's bits do not
depend on how many queries share the call, for chains, token trees and batched rows, on tiny
random models and on the real one; and it is attention (it matches SDPA within rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_llama
from specdec.backends import make_backend
from specdec.backends.native.kernels import attention as attn
from specdec.backends.native.kernels import numba_ops
from specdec.backends.native.model.config import KVRow
from specdec.tree import tree_path


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, max_positions=512)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_by_one(backend, tokens: list[int]) -> torch.Tensor:
    return torch.cat([backend.forward([t]) for t in tokens])


# ---- the routine alone -------------------------------------------------------------------------


def random_cache(kv_heads: int, length: int, dim: int, seed: int):
    """keys [1, kv_heads, dim, L] and values [1, kv_heads, L, dim + 1], as attention.new_cache."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, kv_heads, dim, attn.padded(length), generator=gen)
    v = attn.ones_column(torch.randn(1, kv_heads, attn.padded(length), dim, generator=gen))
    return k, v


@pytest.fixture(params=["kernel", "torch"])
def routine(request, monkeypatch):
    """Both implementations of the contract: the numba kernel and the PyTorch routine."""
    if request.param == "kernel" and not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    monkeypatch.setenv(numba_ops.CHOICE_ENV, request.param)
    return request.param


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 2), (4, 4), (16, 2)])
@pytest.mark.parametrize(("past", "t"), [(0, 1), (5, 8), (60, 9), (64, 3), (190, 17)])
def test_each_query_gets_the_bits_of_a_call_of_its_own(routine, heads, kv_heads, past, t):
    """T queries in one call against each query alone (its keys up to its position): equal bits,
    and both within rounding of SDPA with a causal mask."""
    dim, gen = 16, torch.Generator().manual_seed(past + t)
    q = torch.randn(t, heads, dim, generator=gen)
    k, v = torch.randn(t, kv_heads, dim, generator=gen), torch.randn(t, kv_heads, dim, generator=gen)
    k_cache, v_cache = random_cache(kv_heads, past + t + 70, dim, seed=1)
    together = attn.attention(q, k, v, k_cache, v_cache, [KVRow(0, 0, t, past, past + t, None)],
                              heads != kv_heads)
    for j in range(t):
        row = KVRow(0, 0, 1, past + j, past + j + 1, None)
        alone = attn.attention(q[j : j + 1], k[j : j + 1], v[j : j + 1], k_cache, v_cache, [row],
                               heads != kv_heads)
        assert torch.equal(together[j], alone[0]), j
    keys, values = k_cache[..., : past + t].transpose(2, 3), v_cache[:, :, : past + t, :dim]
    mask = torch.ones(t, past + t, dtype=torch.bool).tril(past)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                              enable_gqa=heads != kv_heads)[0].transpose(0, 1)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-5)


def test_the_kernel_gives_the_same_bits_on_one_thread_or_several():
    """jit.attend_parallel spreads kv heads over numba's threads; heads share
    nothing, so its bits are attend's (chains and tree paths)."""
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    from specdec.backends.native.kernels.jit.attention import attend, attend_parallel

    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = random_cache(4, 200, 16, seed=2)
    q, k, v = (torch.randn(6, 8, 16, generator=gen), torch.randn(6, 4, 16, generator=gen),
               torch.randn(6, 4, 16, generator=gen))
    for plan in (attn.plan_chain(150, 6, 2, "cpu", True),
                 attn.plan_tree(144, [-1, 0, 0, 1, 2, 2], [0, 1, 1, 2, 2, 2], 2, "cpu", True)):
        args = (q.numpy(), k.numpy(), v.numpy(), k_cache.numpy(), v_cache.numpy(), 0, -1, *plan.arrays, 0.25)
        assert torch.equal(torch.from_numpy(attend(*args)), torch.from_numpy(attend_parallel(*args)))


def test_a_fully_masked_chunk_adds_nothing():
    gen = torch.Generator().manual_seed(0)
    parts = torch.randn(2, 5, 3, generator=gen)
    padded = torch.cat([parts, torch.zeros(2, 7, 3)], dim=1)
    assert torch.equal(attn.in_order_sum(parts), attn.in_order_sum(padded))
    assert not torch.equal(attn.in_order_sum(parts), parts.sum(1) + 1e-3)  # it is a sum at all
    torch.testing.assert_close(attn.in_order_sum(parts), parts.sum(1))


def test_tree_parents_from_depth_first_order():
    parents = [-1, 0, 0, 1, 2, 2, 5]
    depths = [0, 1, 1, 2, 2, 2, 3]
    assert attn.tree_parents([0, 1, 3, 2, 4, 5, 6], depths) == (parents, depths)


# ---- through the native backend ----------------------------------------------------------------


@pytest.mark.parametrize("precision", ["int4", "int8"])
@pytest.mark.parametrize("past", [5, 60, 64, 130])  # chains inside one chunk and across chunk bounds
def test_chain_scores_with_the_bits_of_one_token_steps(routine, target, precision, past):
    tokens = random_tokens(past + 12, seed=past)
    chain, steps = (make_backend("native", target, precision=precision) for _ in range(2))
    chain.prefill(tokens[:past])
    steps.prefill(tokens[:past])
    assert torch.equal(chain.forward(tokens[past:]), one_by_one(steps, tokens[past:]))


@pytest.mark.parametrize("past", [0, 7, 62, 129])
@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 2, 2, 5], [-1, -1, 0, 1, 1], [-1, 0, 1, 2, 3, 4, 5, 6, 7]])
def test_tree_nodes_score_with_the_bits_of_their_paths(routine, target, past, parents):
    prefix, nodes = random_tokens(past, seed=past), random_tokens(len(parents), seed=3)
    tree, steps = (make_backend("native", target, precision="int4") for _ in range(2))
    tree.prefill(prefix) if prefix else tree.reset()
    logits = tree.forward_tree(nodes, parents)
    for i in range(len(parents)):
        steps.prefill(prefix) if prefix else steps.reset()
        assert torch.equal(logits[i], one_by_one(steps, [nodes[j] for j in tree_path(parents, i)])[-1]), i


def test_batched_rows_score_with_the_bits_of_one_token_steps(routine, target):
    """Several sequences in one packed forward (the server's SlotPool), each a chain of its own
    length at its own context, against one-token steps of each alone."""
    prefixes = [random_tokens(n, seed=n) for n in (70, 3, 128, 40)]
    chains = [random_tokens(n, seed=90 + n) for n in (5, 1, 9, 0)]
    steps = make_backend("native", target, precision="int4")
    pool = steps.pool.model.new_pool(slots=4)
    seqs = [pool.new_sequence() for _ in prefixes]
    for seq, prefix in zip(seqs, prefixes, strict=True):
        seq.prefill(prefix)
    batched = pool.forward_batch(seqs, chains)
    for prefix, chain, logits in zip(prefixes, chains, batched, strict=True):
        if chain:
            steps.prefill(prefix)
            assert torch.equal(logits, one_by_one(steps, chain))


@pytest.mark.slow
def test_real_model_chains_and_trees_are_bit_identical_to_steps(routine, smollm2):
    """SmolLM2-135M at the cpu default (int4), past a few chunks of context."""
    ids = smollm2.tokenizer.encode(
        "The harbour office opened at seven, and the ferries waited for the fog. " * 12)
    past, chain_ids = ids[:150], ids[150:158]
    chain, steps = (make_backend("native", smollm2) for _ in range(2))
    chain.prefill(past)
    steps.prefill(past)
    assert torch.equal(chain.forward(chain_ids), one_by_one(steps, chain_ids))
    parents = [-1, 0, 0, 1, 2]
    chain.rollback(len(past))
    logits = chain.forward_tree(chain_ids[:5], parents)
    for i in range(len(parents)):
        steps.rollback(len(past))
        path = [chain_ids[j] for j in tree_path(parents, i)]
        assert torch.equal(logits[i], one_by_one(steps, path)[-1]), i
