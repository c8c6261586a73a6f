"""The batch-invariant attention routine (backends/native/attention.py): a query's bits do not
depend on how many queries share the call, for chains, token trees and batched rows, on tiny
random models and on the real one; and it is attention (it matches SDPA within rounding).
Each holds for an fp32 and a bf16 cache (`kv_dtype`); over a bf16 cache the kernel's scores
take bf16 queries and each pair of dims' odd product first (the fp32 kernel's bits for those
values in that order), with the same bits on both of its instruction paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_llama
from specdec.backends import make_backend
from specdec.backends.native.kernels import attention as attn
from specdec.backends.native.kernels import kv_layout, numba_ops
from specdec.backends.native.model.config import KVRow
from specdec.tree import depth_first, tree_depths, tree_path


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, max_positions=512)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_by_one(backend, tokens: list[int]) -> torch.Tensor:
    return torch.cat([backend.forward([t]) for t in tokens])


# ---- the routine alone -------------------------------------------------------------------------


def random_cache(kv_heads: int, length: int, dim: int, seed: int, dtype=torch.float32):
    """keys [1, kv_heads, L / 16, dim, 16] and values [1, kv_heads, L, dim + 1], as
    attention.new_cache."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, kv_heads, dim, attn.padded(length), generator=gen)
    v = attn.ones_column(torch.randn(1, kv_heads, attn.padded(length), dim, generator=gen))
    return blocked_keys(k, dtype), v.to(dtype)


def blocked_keys(keys_t: torch.Tensor, dtype=None) -> torch.Tensor:
    """Keys [..., dim, L] (L a multiple of KEY_TILE) in the cache's blocks [..., L / 16, dim, 16]
    (a bf16 cache's blocks hold pairs of dims: attention.store_keys)."""
    *lead, dim, length = keys_t.shape
    tile = kv_layout.KEY_TILE
    blocks = torch.zeros(*lead, length // tile, dim, tile, dtype=dtype or keys_t.dtype)
    kv_layout.store_keys(blocks, 0, keys_t.transpose(-2, -1))
    return blocks


def bf16_query(qs: np.ndarray) -> np.ndarray:
    """Queries as the kernel scores them against a bf16 cache: 0 below PAIR_FLOOR, else bf16."""
    q = torch.from_numpy(qs)
    return torch.where(q.abs() < kv_layout.PAIR_FLOOR, 0, q).bfloat16().float().numpy()


KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the caches the kernel reads


@pytest.fixture(params=list(KV_DTYPES))
def kv_dtype(request) -> str:
    return request.param


def arrays(caches) -> list:
    """Caches as the jit kernels take them (bf16 as its bits)."""
    return [numba_ops.cache_array(cache) for cache in caches]


@pytest.fixture(params=["kernel", "torch"])
def routine(request, monkeypatch):
    """Both implementations of the contract: the numba kernel and the PyTorch routine."""
    if request.param == "kernel" and not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    monkeypatch.setenv(numba_ops.CHOICE_ENV, request.param)
    return request.param


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 2), (4, 4), (16, 2)])
@pytest.mark.parametrize(("past", "t"), [(0, 1), (5, 8), (60, 9), (64, 3), (190, 17)])
def test_each_query_gets_the_bits_of_a_call_of_its_own(routine, kv_dtype, heads, kv_heads, past, t):
    """T queries in one call against each query alone (its keys up to its position): equal bits,
    and both within rounding of SDPA with a causal mask over the cache's values (the kernel
    weighs a bf16 cache's values with bf16 weights: 2^-9 of each product)."""
    dim, gen = 16, torch.Generator().manual_seed(past + t)
    q = torch.randn(t, heads, dim, generator=gen)
    k, v = torch.randn(t, kv_heads, dim, generator=gen), torch.randn(t, kv_heads, dim, generator=gen)
    k_cache, v_cache = random_cache(kv_heads, past + t + 70, dim, seed=1, dtype=KV_DTYPES[kv_dtype])
    together = attn.attention(q, k, v, k_cache, v_cache, [KVRow(0, 0, t, past, past + t, None)],
                              heads != kv_heads)
    for j in range(t):
        row = KVRow(0, 0, 1, past + j, past + j + 1, None)
        alone = attn.attention(q[j : j + 1], k[j : j + 1], v[j : j + 1], k_cache, v_cache, [row],
                               heads != kv_heads)
        assert torch.equal(together[j], alone[0]), j
    keys, values = kv_layout.keys_of(k_cache, past + t).float(), v_cache[:, :, : past + t, :dim].float()
    mask = torch.ones(t, past + t, dtype=torch.bool).tril(past)
    if routine == "kernel" and kv_dtype == "bf16":  # it scores bf16 queries (scale 1/4: exact)
        q = torch.from_numpy(bf16_query(q.numpy()))
    expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                              enable_gqa=heads != kv_heads)[0].transpose(0, 1)
    tolerance = 8e-3 if routine == "kernel" and kv_dtype == "bf16" else 1e-5
    torch.testing.assert_close(together, expected, rtol=tolerance, atol=tolerance)


def test_the_kernel_gives_the_same_bits_on_one_thread_or_several(kv_dtype):
    """jit.attend_parallel spreads kv heads over numba's threads; heads share
    nothing, so its bits are attend's (chains and tree paths)."""
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    from specdec.backends.native.kernels.jit.attention import attend, attend_parallel

    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = random_cache(4, 200, 16, seed=2, dtype=KV_DTYPES[kv_dtype])
    q, k, v = (torch.randn(6, 8, 16, generator=gen), torch.randn(6, 4, 16, generator=gen),
               torch.randn(6, 4, 16, generator=gen))
    for plan in (attn.plan_chain(150, 6, 2, "cpu", True),
                 attn.plan_tree(144, [-1, 0, 0, 1, 2, 2], [0, 1, 1, 2, 2, 2], 2, "cpu", True)):
        args = (q.numpy(), k.numpy(), v.numpy(), *arrays((k_cache, v_cache)), 0, -1, *plan.arrays, 0.25)
        assert torch.equal(torch.from_numpy(attend(*args)), torch.from_numpy(attend_parallel(*args, 2)))


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "past", "window"),
                         [(4, 1, 64, 1100, None), (4, 1, 256, 1100, 300), (4, 1, 64, 67, None),
                          (2, 1, 32, 700, 129), (3, 1, 16, 2000, None)])
@pytest.mark.parametrize("threads", [2, 3])
def test_a_decode_step_on_one_kv_head_split_over_threads_keeps_its_bits(kv_dtype, heads, kv_heads, dim, past,
                                                                         window, threads):
    """One token over one kv head is one work item: attend_split cuts its keys (the scores) and
    its columns (the weighted sums) across the threads instead, and each lane keeps attend's
    bits (key counts not a multiple of the parts, sliding windows, gemma3's 256 dims)."""
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    from specdec.backends.native.kernels.jit.attention import attend, attend_parallel, splits

    gen = torch.Generator().manual_seed(past + dim)
    k_cache, v_cache = random_cache(kv_heads, past + 70, dim, seed=3, dtype=KV_DTYPES[kv_dtype])
    q, k, v = (torch.randn(1, heads, dim, generator=gen), torch.randn(1, kv_heads, dim, generator=gen),
               torch.randn(1, kv_heads, dim, generator=gen))
    plan = attn.plan_chain(past + 1, 1, heads // kv_heads, "cpu", True, window=window)
    starts = np.zeros(1, np.int64) if plan.starts is None else plan.starts.numpy()
    limits, paths = plan.limits.numpy(), plan.paths.numpy()
    assert splits(np.array([0, 1]), paths, heads // kv_heads, kv_heads, dim, threads)
    args = (q.numpy(), k.numpy(), v.numpy(), *arrays((k_cache, v_cache)), 0, past, limits, paths, starts,
            np.float32(dim**-0.5))
    want = attend(*args)
    got = attend_parallel(*args, threads)  # stores the key again, as the same bits
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize(("rows", "tokens", "heads", "kv_heads", "dim", "tree", "threads", "split"), [
    (1, 1, 4, 1, 64, False, 2, True),  # gemma3's decode step: one item, two threads
    (1, 1, 9, 3, 64, False, 2, False),  # three items on two threads: dealt whole (measured faster)
    (2, 1, 4, 1, 64, False, 2, False),  # two rows: an item each
    (1, 2, 4, 1, 64, False, 2, False),  # a chain's eight lanes: more than a register tile
    (1, 1, 4, 1, 64, True, 2, False),  # a tree path
    (1, 1, 4, 1, 24, False, 2, False),  # no whole tiles of columns
    (1, 1, 4, 1, 64, False, 1, False),  # one thread
])
def test_which_calls_split_a_work_item(rows, tokens, heads, kv_heads, dim, tree, threads, split):
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    from specdec.backends.native.kernels.jit.attention import splits

    offsets = np.arange(rows + 1, dtype=np.int64) * tokens
    paths = np.full((rows * tokens, 1), 0 if tree else -1, np.int64)
    assert splits(offsets, paths, heads // kv_heads, kv_heads, dim, threads) == split


@pytest.mark.parametrize("past", [0, 7, 62, 129])
@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 2, 2, 5], [-1, -1, 0, 1, 1]])
def test_a_tree_node_gets_the_bits_of_its_path_attended_step_by_step(routine, kv_dtype, past, parents):
    """The routine's own outputs (the logits of a small model round them away, see below): a
    token tree's node against its path attended one token per step, each step storing its key
    first. With a bf16 cache the tree must round its own keys and values as the cache holds
    them, or a node would weigh its ancestors with bits a step never sees."""
    heads, kv_heads, dim, t = 6, 2, 16, len(parents)
    gen = torch.Generator().manual_seed(past)
    q = torch.randn(t, heads, dim, generator=gen)
    k, v = torch.randn(t, kv_heads, dim, generator=gen), torch.randn(t, kv_heads, dim, generator=gen)
    cache = random_cache(kv_heads, past + t + 70, dim, seed=4, dtype=KV_DTYPES[kv_dtype])
    depths = tree_depths(parents)
    row = KVRow(0, 0, t, past, past + t, None, tree=(depth_first(parents), depths), tree_kv=[])
    tree = attn.attention(q, k, v, *(c.clone() for c in cache), [row], True)
    for i in range(t):
        k_cache, v_cache = (c.clone() for c in cache)
        for depth, node in enumerate(tree_path(parents, i)):
            step = KVRow(0, 0, 1, past + depth, past + depth + 1, None)
            out = attn.attention(q[node : node + 1], k[node : node + 1], v[node : node + 1], k_cache, v_cache,
                                 [step], True)
        assert torch.equal(tree[i], out[0]), i


def test_the_kernel_takes_fp32_and_bf16_caches_and_the_routine_the_rest(monkeypatch):
    """numba_ops.usable: fp32 and bf16 caches on the kernel, fp16 on the PyTorch routine; and
    SPECDEC_ATTENTION=torch or the forced fallback put every cache on the routine."""
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    cpu = torch.device("cpu")
    assert numba_ops.usable(cpu, torch.float32) and numba_ops.usable(cpu, torch.bfloat16)
    assert not numba_ops.usable(cpu, torch.float16)
    assert not numba_ops.usable(torch.device("meta"), torch.float32)
    with pytest.raises(ValueError, match="reads fp32 and bf16"):
        numba_ops.cache_array(torch.zeros(4, dtype=torch.float16))
    for variable, value in ((numba_ops.CHOICE_ENV, "torch"), ("SPECDEC_CPU_KERNELS", "fallback")):
        with monkeypatch.context() as patched:
            patched.setenv(variable, value)
            assert not any(numba_ops.usable(cpu, dtype) for dtype in KV_DTYPES.values())


def sequential_scores(keys: np.ndarray, qs: np.ndarray, paired: bool = False) -> np.ndarray:
    """s[r, i] = sum over d of qs[r, d] * keys[d, i], added one product after another from 0;
    `paired`: each pair's odd dim first, the queries rounded to bf16 (a bf16 cache's scores)."""
    s = np.zeros((qs.shape[0], keys.shape[1]), np.float32)
    if paired:
        qs = bf16_query(qs)
    for n in range(keys.shape[0]):
        d = n ^ 1 if paired else n
        s = s + qs[:, d : d + 1] * keys[d][None, :]
    return s


def sequential_sums(values: np.ndarray, w: np.ndarray) -> np.ndarray:
    """acc[r, c] = sum over keys i of w[r, i] * values[i, c], one key after another from 0."""
    acc = np.zeros((w.shape[0], values.shape[1]), np.float32)
    for i in range(values.shape[0]):
        acc = acc + w[:, i : i + 1] * values[i][None, :]
    return acc


@pytest.mark.parametrize(("lanes", "dim", "keys"), [(4, 64, 100), (3, 64, 67), (9, 32, 200), (1, 16, 35),
                                                     (11, 64, 1100), (8, 48, 16), (2, 24, 50), (16, 64, 300),
                                                     (13, 64, 129), (10, 16, 64), (4, 256, 130),
                                                     (6, 64, 2100)])
@pytest.mark.parametrize("form", ["tiles", "blocks"])
def test_the_kernels_register_tiles_keep_every_sum_in_order(kv_dtype, lanes, dim, keys, form):
    """Scores and weighted sums, tiles of keys and columns held in registers (jit/attention_tiles)
    plus the loops for the rest, against the sums written out one product at a time: the same
    bits for every lane, key and column (dim 24 has no whole tiles of columns: the plain loops;
    2100 keys of an fp32 cache take the loops at any lane count).
    `blocks`: the same over blocks of keys widened to fp32 for every lane (attention_sums), with
    lanes that read different numbers of keys, as a chain's do."""
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    from specdec.backends.native.kernels.jit import attention_sums as jit

    gen = torch.Generator().manual_seed(lanes * 1000 + keys)
    keys_t = torch.randn(dim, keys, generator=gen).to(KV_DTYPES[kv_dtype])
    values = attn.ones_column(torch.randn(keys, dim, generator=gen)).to(KV_DTYPES[kv_dtype])
    qs = torch.randn(lanes, dim, generator=gen).numpy()
    if kv_dtype == "bf16":  # the kernel rounds them before its scores (jit/attention.head)
        qs = bf16_query(qs)
    weights = torch.rand(lanes, keys, generator=gen)
    if kv_dtype == "bf16":  # so are the weights (jit/attention.lane_weights)
        weights = weights.bfloat16().float()
    weights = weights.numpy()
    counts = np.full(lanes, keys, np.int64)
    if form == "blocks":
        counts -= np.arange(lanes)[::-1] // 3  # a chain: each query reads one key more than the last
    scores, sums = (jit.scores, jit.weighted_sums) if form == "tiles" else (jit.scores_blocked,
                                                                            jit.weighted_sums_blocked)
    whole = -(-keys // kv_layout.KEY_TILE) * kv_layout.KEY_TILE  # the cache's blocks, the last one padded
    cache = numba_ops.cache_array(blocked_keys(F.pad(keys_t, (0, whole - keys))))
    expected = sequential_scores(keys_t.float().numpy(), qs, kv_dtype == "bf16").view(np.int32).tolist()
    for width in (keys, whole):  # the last block's keys one at a time, or a tile past the last key
        s = np.full((lanes, width), np.nan, np.float32)
        scores(cache, qs, s, 0, keys)
        assert s[:, :keys].view(np.int32).tolist() == expected, width
    acc = np.empty((lanes, dim), np.float32)
    if form == "tiles":
        jit.weighted_sums(numba_ops.cache_array(values.contiguous()), weights, acc, 0, counts, 0, dim)
    else:
        sums(numba_ops.cache_array(values.contiguous()), weights, acc, 0, counts)
    if form == "tiles" and dim % 16 == 0:  # in parts of columns, as attend_split takes them
        parts = np.full((lanes, dim), np.nan, np.float32)
        for c0 in range(0, dim, 16):
            jit.weighted_sums(numba_ops.cache_array(values.contiguous()), weights, parts, 0, counts, c0,
                              c0 + 16)
        assert parts.view(np.int32).tolist() == acc.view(np.int32).tolist()
    for lane in range(lanes):  # the ones column is not read: the normaliser is the softmax's (below)
        expected = sequential_sums(values[: counts[lane], :dim].float().numpy(),
                                   weights[lane : lane + 1, : counts[lane]])
        assert acc[lane].view(np.int32).tolist() == expected[0].view(np.int32).tolist(), lane


def fixed_order_total(w: np.ndarray, first: int, count: int) -> np.float32:
    """softmax.weights_total written out: 32 running sums from `first` rounded down to a multiple
    of 32 (sum j takes the elements at j, j + 32, ...), added in order, then the rest one by one."""
    start = first // 32 * 32
    end = start + (count - start) // 32 * 32
    partial = np.zeros(32, np.float32)
    for i in range(start, end):
        partial[i % 32] = np.float32(partial[i % 32] + w[i])
    total = np.float32(0)
    for j in range(32):
        total = np.float32(total + partial[j])
    for i in range(end, count):
        total = np.float32(total + w[i])
    return total


@pytest.mark.parametrize(("first", "count"), [(0, 1), (0, 31), (0, 32), (0, 47), (0, 100), (5, 70), (33, 64),
                                              (3, 120), (40, 1000)])
def test_the_softmax_normaliser_adds_in_its_fixed_order(first, count):
    """The normaliser (softmax.weights_total) against its order written out, over weights with
    exact zeros before `first` (a sliding window's), and the numerators and the maximum it
    follows against exp_nonpositive and max: the same bits."""
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    from specdec.backends.native.kernels.jit import norms, softmax

    gen = torch.Generator().manual_seed(count)
    s = (torch.randn(count + 7, generator=gen) * 20).numpy()
    top = softmax.largest(s, count)
    assert top == s[:count].max()
    w = np.full(count + 7, np.nan, np.float32)
    softmax.exp_shifted(s, top, count, w)
    expected, bits = np.empty(count, np.float32), np.empty(count, np.int32)
    norms.exp_nonpositive(s[:count] - top, count, expected, bits)
    assert w[:count].view(np.int32).tolist() == expected.view(np.int32).tolist()
    assert np.isnan(w[count:]).all()  # nothing past the scores written
    w[:first] = 0
    total = np.float32(softmax.weights_total(w, first, count))  # numba hands back the float32 as a float
    assert total.view(np.int32) == fixed_order_total(w, first, count).view(np.int32)


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
def test_chain_scores_with_the_bits_of_one_token_steps(routine, kv_dtype, target, precision, past):
    tokens = random_tokens(past + 12, seed=past)
    chain, steps = (make_backend("native", target, precision=precision, kv_dtype=kv_dtype) for _ in range(2))
    chain.prefill(tokens[:past])
    steps.prefill(tokens[:past])
    assert torch.equal(chain.forward(tokens[past:]), one_by_one(steps, tokens[past:]))


@pytest.mark.parametrize("past", [0, 7, 62, 129])
@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 2, 2, 5], [-1, -1, 0, 1, 1], [-1, 0, 1, 2, 3, 4, 5, 6, 7]])
def test_tree_nodes_score_with_the_bits_of_their_paths(routine, kv_dtype, target, past, parents):
    prefix, nodes = random_tokens(past, seed=past), random_tokens(len(parents), seed=3)
    tree, steps = (make_backend("native", target, precision="int4", kv_dtype=kv_dtype) for _ in range(2))
    tree.prefill(prefix) if prefix else tree.reset()
    logits = tree.forward_tree(nodes, parents)
    for i in range(len(parents)):
        steps.prefill(prefix) if prefix else steps.reset()
        assert torch.equal(logits[i], one_by_one(steps, [nodes[j] for j in tree_path(parents, i)])[-1]), i


def test_batched_rows_score_with_the_bits_of_one_token_steps(routine, kv_dtype, target):
    """Several sequences in one packed forward (the server's SlotPool), each a chain of its own
    length at its own context, against one-token steps of each alone."""
    prefixes = [random_tokens(n, seed=n) for n in (70, 3, 128, 40)]
    chains = [random_tokens(n, seed=90 + n) for n in (5, 1, 9, 0)]
    steps = make_backend("native", target, precision="int4", kv_dtype=kv_dtype)
    pool = steps.pool.model.new_pool(slots=4, kv_dtype=KV_DTYPES[kv_dtype])
    seqs = [pool.new_sequence() for _ in prefixes]
    for seq, prefix in zip(seqs, prefixes, strict=True):
        seq.prefill(prefix)
    batched = pool.forward_batch(seqs, chains)
    for prefix, chain, logits in zip(prefixes, chains, batched, strict=True):
        if chain:
            steps.prefill(prefix)
            assert torch.equal(logits, one_by_one(steps, chain))


@pytest.mark.slow
def test_real_model_chains_and_trees_are_bit_identical_to_steps(routine, kv_dtype, smollm2):
    """SmolLM2-135M at the cpu default (its GGUF's own types), past a few chunks of context."""
    ids = smollm2.tokenizer.encode(
        "The harbour office opened at seven, and the ferries waited for the fog. " * 12)
    past, chain_ids = ids[:150], ids[150:158]
    chain, steps = (make_backend("native", smollm2, kv_dtype=kv_dtype) for _ in range(2))
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
