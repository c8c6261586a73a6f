"""A bf16 cache's scores (kernels/attention.py, jit/attention_tiles.py): bf16 queries times
bf16 keys held in pairs of dims, each pair's odd product first; what the kernel stores; and the
two instruction paths (vdpbf16ps and its fp32 replica) giving the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.backends.native.kernels import attention as attn
from specdec.backends.native.kernels import kv_layout, numba_ops
from test_attention import arrays, bf16_query, blocked_keys, random_cache


def swapped_pairs(x: torch.Tensor) -> torch.Tensor:
    """The last dim's pairs swapped (dims 1, 0, 3, 2, ...): a bf16 cache's order of a score's
    products, as an fp32 kernel adds them in order."""
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


@pytest.mark.parametrize("threads", ["attend", "attend_parallel"])
def test_the_kernel_attends_a_bf16_cache_in_pairs_of_bf16_products(threads):
    """Over a bf16 cache a score multiplies bf16 queries by bf16 keys, each pair of dims' odd
    product first (vdpbf16ps's order), and the weighted sums bf16 weights by bf16 values (their
    bits: test_attention's register tiles test): within that rounding of the fp32 kernel given
    the rounded queries, keys and values with each pair of dims swapped, and not within the
    scores' rounding of it unswapped, for chains and trees, stored (store >= 0, as the one-call
    layers store a tree's nodes) or not; what it stores is torch's cast."""
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    import specdec.backends.native.kernels.jit.attention as jit

    kernel, gen = getattr(jit, threads), torch.Generator().manual_seed(5)

    def attend(*args):
        return kernel(*args, 2) if threads == "attend_parallel" else kernel(*args)

    q, k, v = (torch.randn(6, 9, 64, generator=gen), torch.randn(6, 3, 64, generator=gen),
               torch.randn(6, 3, 64, generator=gen))
    bf16 = random_cache(3, 1200, 64, seed=6, dtype=torch.bfloat16)
    plans = ((attn.plan_chain(1100, 6, 3, "cpu", True), 1094),
             (attn.plan_chain(1100, 6, 3, "cpu", True, window=300), 1094),
             (attn.plan_tree(1000, [-1, 0, 0, 1, 2, 2], [0, 1, 1, 2, 2, 2], 3, "cpu", True), -1),
             (attn.plan_tree(1000, [-1, 0, 1, -1, 3, 3], [0, 1, 2, 0, 1, 1], 3, "cpu", True), 1000))
    rounded_q = swapped_pairs(torch.from_numpy(bf16_query(q.numpy()))).numpy()  # scale 1/8: exact
    rounded = [swapped_pairs(k.bfloat16().float()).numpy(), v.bfloat16().float().numpy()]
    for plan, store in plans:
        narrow = [c.clone() for c in bf16]
        wide = [blocked_keys(swapped_pairs(kv_layout.keys_of(bf16[0], 1200).float()).transpose(-2, -1)),
                bf16[1].float()]
        got = attend(q.numpy(), k.numpy(), v.numpy(), *arrays(narrow), 0, store, *plan.arrays, 0.125)
        want = attend(rounded_q, *rounded, *arrays(wide), 0, store, *plan.arrays, 0.125)
        np.testing.assert_allclose(got, want, rtol=0, atol=4e-3)  # the weights' 2^-9
        assert not np.array_equal(got, want)
        keys_of = kv_layout.keys_of
        stored = swapped_pairs(keys_of(narrow[0], 1200).float())
        assert torch.equal(stored, keys_of(wide[0], 1200)) and torch.equal(narrow[1].float(), wide[1])
        same_values = [blocked_keys(keys_of(bf16[0], 1200).float().transpose(-2, -1)), bf16[1].float()]
        in_order = attend(bf16_query(q.numpy()), k.bfloat16().float().numpy(), rounded[1],
                          *arrays(same_values),
                          0, store, *plan.arrays, 0.125)
        assert abs(in_order - want).max() > 0  # the order shows in the fp32 kernel's bits


def test_the_kernel_stores_bf16_as_torch_casts_it():
    """Keys and values stored by the kernel into a bf16 cache: torch's cast bit for bit (to
    nearest, ties to even), over ties, halfway values at each exponent, infinities, values that
    round up to infinity, subnormals and signed zeros; a NaN stays a NaN. Keys and values below
    PAIR_FLOOR are stored as 0, as kv_layout.store_keys and store_values store them."""
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31, (4, 3, 64), generator=gen, dtype=torch.int64)
    bits[0] = (bits[0] & ~0xFFFF) | 0x8000  # exact ties: even and odd high halves
    bits[1, 0, :8] = torch.tensor([0x7F800000, -0x800000, 0x7F7FFFFF, 0x7F7F8000, 1, 0x8000, 0, -(2**31)])
    k = bits.to(torch.int32).view(torch.float32)
    k = torch.where(k.isnan(), torch.full_like(k, 2.5), k)
    k[3, 0, 0] = float("nan")
    k[2, 0, :2] = torch.tensor([2.0**-56, -(2.0**-57)])  # the floor itself is kept, below it is 0
    k_cache, v_cache = attn.new_cache((1,), 3, 64, 64, dtype=torch.bfloat16)
    numba_ops.attend_kernel(torch.zeros(4, 3, 64), k, -k, k_cache, v_cache, 0, 0, np.arange(1, 5),
                            np.full((4, 0), -1))
    stored_k = kv_layout.keys_of(k_cache[0], 4).transpose(0, 1)
    stored_v = v_cache[0, :, :4, :64].transpose(0, 1)
    no_nan = torch.where(k.isnan(), 1.0, k)  # the places of a cache's pairs, alike
    by_kernel, _ = attn.new_cache((1,), 3, 64, 64, dtype=torch.bfloat16)
    numba_ops.attend_kernel(torch.zeros(4, 3, 64), no_nan, no_nan, by_kernel, v_cache.clone(), 0, 0,
                            np.arange(1, 5), np.full((4, 0), -1))
    by_torch = torch.zeros_like(by_kernel)
    kv_layout.store_keys(by_torch[0], 0, no_nan.transpose(0, 1))
    assert torch.equal(by_kernel.view(torch.int16), by_torch.view(torch.int16))
    finite = ~k.isnan()
    floored = torch.where(k.abs() < kv_layout.PAIR_FLOOR, 0, k)
    assert floored[2, 0, 0] != 0 and floored[2, 0, 1] == 0 and (floored == 0).sum() > (k == 0).sum() + 1
    assert torch.equal(stored_k[finite].view(torch.int16), floored[finite].bfloat16().view(torch.int16))
    negated = torch.where(k.abs() < kv_layout.PAIR_FLOOR, 0, -k)  # the values: +0 below the floor
    assert torch.equal(stored_v[finite].view(torch.int16), negated[finite].bfloat16().view(torch.int16))
    by_torch = torch.zeros_like(v_cache)
    kv_layout.store_values(by_torch[0], 0, -k.transpose(0, 1))
    assert torch.equal(by_torch[0, :, :4, :64][finite.transpose(0, 1)].view(torch.int16),
                       v_cache[0, :, :4, :64][finite.transpose(0, 1)].view(torch.int16))
    assert stored_k[3, 0, 0].isnan() and stored_v[3, 0, 0].isnan()


def test_softmax_weights_round_to_bf16_as_the_sums_take_them():
    """round_weights (a bf16 cache's softmax weights, in integer steps that vectorise) against
    torch's cast with the floor: ties to even at both parities, the floor itself kept and just
    below it 0, 1 and 0 as they are, and weights spread from 1 down past the floor."""
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    from specdec.backends.native.kernels.jit import attention_sums

    gen = torch.Generator().manual_seed(9)
    w = torch.exp(-60 * torch.rand(4096, generator=gen))  # e^-60: below PAIR_FLOOR (e^-38.8)
    w[:4] = torch.tensor([1.0, 0.0, kv_layout.PAIR_FLOOR, kv_layout.PAIR_FLOOR * (1 - 2**-20)])
    bits = w.view(torch.int32)
    bits[4:260] = (bits[4:260] & ~0xFFFF) | 0x8000  # exact ties
    assert (bits[4:260] & 0x10000).unique().numel() == 2  # ties of both parities
    got = w.numpy().copy()
    attention_sums.round_weights(got)
    want = torch.where(w < kv_layout.PAIR_FLOOR, 0, w).bfloat16().float()
    assert (want == 0).sum() > 100 and want[2] > 0 and want[3] == 0
    assert torch.equal(torch.from_numpy(got).view(torch.int32), want.view(torch.int32))


PATH_CHECK = """
import hashlib, numpy as np, torch
from specdec.backends.native.kernels import attention as attn
from specdec.backends.native.kernels import kv_layout, numba_ops
from specdec.backends.native.kernels.jit import attention as jit, ir
assert ir.BF16_DOT == {dot}
gen = torch.Generator().manual_seed(11)
q, k, v = (torch.randn(5, 9, 64, generator=gen), torch.randn(5, 3, 64, generator=gen),
           torch.randn(5, 3, 64, generator=gen))
k_cache, v_cache = attn.new_cache((1,), 3, 400, 64, dtype=torch.bfloat16)
keys = torch.randn(3, 400, 64, generator=gen)
keys[:, ::3] *= 2.0**-70  # products below fp32's normal range but for PAIR_FLOOR
q[:, :4] *= 2.0**-70
q[:, 6:] *= 12  # scores far apart: weights below PAIR_FLOOR, and above it with subnormal products
values = torch.randn(3, 400, 64, generator=gen)
values[:, ::5] *= 2.0**-70
kv_layout.store_keys(k_cache[0], 0, keys)
kv_layout.store_values(v_cache[0], 0, values)
digest = hashlib.sha256()
cache = numba_ops.cache_array(k_cache)
scaled = q[:, 0].numpy() * 0.125  # head 0 of each query, as attend scales it
qs = np.array([[jit.pair_operand(np.float32(x), cache) for x in row] for row in scaled], np.float32)
for score in (jit.scores, jit.scores_blocked):  # the scores themselves
    s = np.zeros((5, 400), np.float32)
    score(cache[0, 0], qs, s, 0, 400)
    digest.update(s.tobytes())
# weighted sums whose every product is subnormal but for the floors: column 0 holds values of 2^-50
# at keys weighing 2^-81 .. 2^-101 (weights below the floor), column 1 values of 2^-75 (below it) at
# keys weighing 2^-52 .. 2^-55, and the other keys hold 0 there
s = np.zeros((8, 416), np.float32)
s[:, :400] = -(np.arange(400) % 80) - np.arange(8)[:, None] / 8
values = torch.zeros(1, 400, 64)
values[0, (np.arange(400) % 80 >= 56) & (np.arange(400) % 80 < 70), 0] = 2.0**-50
values[0, (np.arange(400) % 80 >= 36) & (np.arange(400) % 80 < 39), 1] = 2.0**-75
values[0, :, 2:] = torch.randn(400, 62, generator=gen)
_, tiny = attn.new_cache((1,), 1, 400, 64, dtype=torch.bfloat16)
kv_layout.store_values(tiny[0], 0, values)
tiny = numba_ops.cache_array(tiny)[0, 0]
for x in range(8):
    jit.lane_weights(s, np.zeros((8, 64), np.float32), x, 0, 400, np.empty(0, np.int64), k.numpy(), 0, tiny)
acc = np.zeros((8, 64), np.float32)
jit.weighted_sums(tiny, s, acc, 0, np.full(8, 400), 0, 64)
digest.update(acc.tobytes())
for plan, store in ((attn.plan_chain(390, 5, 3, "cpu", True), 385),
                    (attn.plan_tree(380, [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], 3, "cpu", True), -1)):
    caches = [numba_ops.cache_array(c.clone()) for c in (k_cache, v_cache)]
    for threads in (1, 2):
        out = jit.attend_parallel(q.numpy(), k.numpy(), v.numpy(), *caches, 0, store, *plan.arrays, 0.125,
                                  threads)
        digest.update(out.tobytes())
    digest.update(caches[0].tobytes())
print(digest.hexdigest())
"""


@pytest.mark.slow
def test_both_instruction_paths_of_bf16_attention_give_the_same_bits():
    """vdpbf16ps (AVX-512 BF16) and its replica in fp32 multiplies and adds (the scores) or the
    fp32 loops (the weighted sums), each compiled in a process of its own, over keys, queries,
    values and weights small enough that, but for PAIR_FLOOR, partial sums would be subnormal
    (which vdpbf16ps flushes): the same outputs and stored keys."""
    if not attn.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    from specdec.backends.native.kernels.jit import ir

    paths = ["0"] + (["1"] if ir.BF16_DOT else [])
    digests = set()
    for dot in paths:
        env = {**os.environ, ir.BF16_DOT_ENV: dot}
        done = subprocess.run([sys.executable, "-c", PATH_CHECK.format(dot=dot == "1")], env=env,
                              capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=600)
        assert done.returncode == 0, f"{dot}: {done.stderr[-2000:]}"
        digests.add(done.stdout.strip())
    assert len(digests) == 1, digests
    if not ir.BF16_DOT:
        pytest.skip("this CPU has no AVX-512 BF16: only the replica ran")


def test_the_bf16_scores_path_follows_the_cpu_features():
    from specdec.backends.native.kernels.jit.ir import bf16_dot_for

    assert bf16_dot_for("+avx2,+avx512bf16,+avx512vnni")
    assert not bf16_dot_for("+avx2,-avx512bf16,+avx512vnni") and not bf16_dot_for("+neon,+bf16")
