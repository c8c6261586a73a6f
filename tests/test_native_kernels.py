"""The native backend's CPU kernel choices (issue 15): dispatch and its forced pure-PyTorch
fallback, bit-for-bit batch invariance per row of every linear a default model uses, the
8-bit LM head against GGUF's Q8_0 blocks, and speculative == plain greedy on both paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_llama
from specdec import Engine, SpecdecError
from specdec.backends import make_backend
from specdec.backends.native.kernels import attention, numba_ops
from specdec.backends.native.kernels.cpu import FORCE_ENV, cpu_features
from specdec.backends.native.kernels.ort import OrtBlockLinear, ort_available, quantize_symmetric
from specdec.backends.native.kernels.precisions import Int4Linear, Int8Linear, make_linear, make_lm_head
from specdec.backends.native.model.native_model import NativeModel

needs_ort = pytest.mark.skipif(not ort_available(), reason="onnxruntime/onnx not installed")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3)


@pytest.fixture(params=["fast", "fallback"])
def kernels(request, monkeypatch):
    """Each test runs on this CPU's fast paths and with the pure-PyTorch fallback forced."""
    if request.param == "fallback":
        monkeypatch.setenv(FORCE_ENV, "fallback")
    else:
        monkeypatch.delenv(FORCE_ENV, raising=False)
    return request.param


def rows_are_invariant(layer, k: int, dtype: torch.dtype, max_rows: int = 9) -> bool:
    """Row i of an M-row call equals the same row called alone, bit for bit, for every M."""
    x = torch.randn(max_rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    with torch.no_grad():
        alone = [layer(x[i : i + 1].clone())[0] for i in range(max_rows)]
        for m in range(2, max_rows + 1):
            out = layer(x[:m].clone())
            if not all(torch.equal(out[i], alone[i]) for i in range(m)):
                return False
    return True


@pytest.mark.parametrize("hidden", [576, 64, 37])  # 37: the tail past the 16-lane partial sums
def test_numba_rms_norm_matches_torch_and_is_row_invariant(hidden):
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(hidden)
    x, weight = torch.randn(9, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
    got = numba_ops.rms_norm_bf16(x, weight, 1e-5)
    want = F.rms_norm(x, (hidden,), weight, 1e-5)
    assert got.dtype == torch.bfloat16
    # within one bf16 step of the fp32 norm (the two sum the squares in different orders)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-6)
    assert not torch.equal(got.float(), (want * 1.02).to(torch.bfloat16).float())  # a wrong scale fails
    assert all(torch.equal(numba_ops.rms_norm_bf16(x[i : i + 1].clone(), weight, 1e-5)[0], got[i])
               for i in range(9))
    x[0, 0] = float("nan")
    assert numba_ops.rms_norm_bf16(x[:1].clone(), weight, 1e-5).isnan().all()


def test_numba_split_rotate_gives_the_bits_of_the_pytorch_ops():
    """q, k rotated and v split from a bf16 q|k|v row: the same products and sums, rounded as
    layer.rope's three ops round them, so the same bits."""
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    from specdec.backends.native.model.layer import rope

    heads, kv_heads, dim, n = 9, 3, 64, 5
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    cos, sin = torch.randn(n, 1, dim, generator=gen), torch.randn(n, 1, dim, generator=gen)
    q, k, v = numba_ops.split_rotate(qkv, cos, sin, heads, kv_heads)
    full = qkv.float()
    qk = rope(full[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim), cos, sin)
    assert torch.equal(q, qk[:, :heads]) and torch.equal(k, qk[:, heads:])
    assert torch.equal(v, full[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim))


@pytest.mark.parametrize("hidden", [640, 37])
def test_numba_fp32_norm_tracks_torch_and_is_row_invariant(hidden):
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(hidden)
    x, weight = torch.randn(9, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
    got = numba_ops.rms_norm_f32(x, weight, 1e-6)
    want = F.rms_norm(x, (hidden,), weight, 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the squares summed in another order
    assert not torch.allclose(got, want * 1.001, rtol=1e-5, atol=1e-6)  # a wrong scale fails
    assert all(torch.equal(numba_ops.rms_norm_f32(x[i : i + 1].clone(), weight, 1e-6)[0], got[i])
               for i in range(9))


@pytest.mark.parametrize("normed", [True, False])
def test_numba_split_norm_rotate_tracks_the_pytorch_ops(normed):
    """fp32 q|k|v: q and k heads RMS-normed (qwen3, gemma3) then rotated as layer.rope rounds
    it, v split; rows independent."""
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    from specdec.backends.native.model.layer import rope

    heads, kv_heads, dim, n = 4, 2, 64, 5
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen) * 2
    cos, sin = torch.randn(n, 1, dim, generator=gen), torch.randn(n, 1, dim, generator=gen)
    norms = (torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)) if normed else None
    q, k, v = numba_ops.split_norm_rotate(qkv, cos, sin, heads, kv_heads, norms, 1e-6)
    qk = qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
    if normed:
        qk = torch.cat([F.rms_norm(qk[:, :heads], (dim,), norms[0], 1e-6),
                        F.rms_norm(qk[:, heads:], (dim,), norms[1], 1e-6)], dim=1)
    want = rope(qk, cos, sin)
    check = (torch.testing.assert_close if normed
             else lambda a, b: torch.equal(a, b) or pytest.fail("bits differ"))
    check(q, want[:, :heads])
    check(k, want[:, heads:])
    assert torch.equal(v, qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim))
    if normed:  # the k weights, not the q weights, scale the k heads
        swapped = numba_ops.split_norm_rotate(qkv, cos, sin, heads, kv_heads, norms[::-1], 1e-6)[1]
        assert not torch.allclose(swapped, want[:, heads:])
    one = numba_ops.split_norm_rotate(qkv[2:3].clone(), cos[2:3].clone(), sin[2:3].clone(), heads, kv_heads,
                                      norms, 1e-6)
    assert torch.equal(one[0][0], q[2]) and torch.equal(one[1][0], k[2])


def test_numba_add_rms_norm_gives_the_bits_of_the_add_then_the_norm():
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(5, 576, generator=gen) * 3, torch.randn(576, generator=gen)
    delta = torch.randn(5, 576, generator=gen).to(torch.bfloat16)
    total, normed = numba_ops.add_rms_norm_bf16(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)  # PyTorch's promoting add
    assert torch.equal(normed, numba_ops.rms_norm_bf16(x + delta, weight, 1e-5))
    assert not torch.equal(normed, numba_ops.rms_norm_bf16(x, weight, 1e-5))  # the delta counts


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("past", "t"), [(0, 1), (37, 1), (100, 4), (250, 9)])
def test_rotate_attend_gives_the_bits_of_its_three_steps(past, t, kv_dtype):
    """One call for a chain row (rotation, attention, the cast to bf16) against split_rotate,
    the attention kernel and torch's cast, each cache (fp32 or bf16) written by its own path."""
    if not attention.uses_kernel("cpu"):
        pytest.skip("numba is not installed")
    heads, kv_heads, dim = 9, 3, 64
    gen = torch.Generator().manual_seed(past + t)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    cos, sin = torch.randn(t, 1, dim, generator=gen), torch.randn(t, 1, dim, generator=gen)
    caches = [attention.new_cache((2,), kv_heads, 300, dim, dtype=kv_dtype) for _ in range(2)]
    for k_cache, v_cache in caches:
        k_cache.copy_(torch.randn(k_cache.shape, generator=torch.Generator().manual_seed(7)))
        v_cache[..., :dim] = torch.randn(v_cache[..., :dim].shape, generator=torch.Generator().manual_seed(8))
    limits, paths, _ = attention.plan_chain(past + t, t, heads // kv_heads, "cpu", kernel=True).arrays
    fused = numba_ops.rotate_attend(qkv, cos, sin, heads, kv_heads, *caches[0], 1, past, limits, paths)
    q, k, v = numba_ops.split_rotate(qkv, cos, sin, heads, kv_heads)
    steps = numba_ops.attend_kernel(q, k, v, *caches[1], 1, past, limits, paths).reshape(t, heads * dim)
    assert fused.dtype == torch.bfloat16 and torch.equal(fused, steps.to(torch.bfloat16))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])  # both stored


def test_numba_silu_mul_tracks_pytorch_and_is_row_invariant():
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(7, 2 * 1536, generator=gen) * 4).to(torch.bfloat16)
    got = numba_ops.silu_mul_bf16(gate_up)
    gate, up = gate_up.float().split(1536, dim=-1)
    torch.testing.assert_close(got.float(), F.silu(gate) * up, rtol=2**-7, atol=1e-5)  # one bf16 step
    assert not torch.equal(got.float(), (F.silu(gate) * up * 1.02).to(torch.bfloat16).float())
    assert all(torch.equal(numba_ops.silu_mul_bf16(gate_up[i : i + 1].clone())[0], got[i]) for i in range(7))


def test_layers_norm_with_numba_only_on_the_fast_path(target, kernels):
    backend = make_backend("native", target, precision="int4")
    fast = [layer.fast for layer in backend.pool.model.layers]
    assert all(fast) if kernels == "fast" and numba_ops.importable() else not any(fast)


def test_cpu_features_are_read():
    features = cpu_features()
    assert isinstance(features, frozenset)
    assert any(f.startswith("torch:") for f in features) or not features


def test_dispatch_follows_the_forced_fallback(kernels):
    w = torch.randn(96, 64)
    head = make_lm_head(w, None, "int4")
    if kernels == "fallback":
        assert isinstance(head, Int8Linear)
        assert isinstance(make_linear(w, None, "int4"), Int8Linear)
    else:
        assert isinstance(head, OrtBlockLinear if ort_available() else Int8Linear)
        assert isinstance(make_linear(w, None, "int4"), Int4Linear)
    assert isinstance(make_lm_head(w, None, "int4", "int4"), Int4Linear if kernels == "fast" else Int8Linear)
    assert isinstance(make_lm_head(w, None, "int4", "int8"), Int8Linear)
    assert make_lm_head(w, None, "bf16").weight.dtype == torch.bfloat16  # other precisions keep theirs


@pytest.mark.parametrize("threads", [1, 2])
def test_every_default_linear_is_batch_invariant(target, kernels, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = NativeModel.from_hf(target.model, "int4")
        layer = model.layers[0]
        linears = [layer.qkv.fused, layer.o, layer.gate_up.fused, layer.down, model.lm_head]
        for linear in linears:
            k = linear.in_features if isinstance(linear, OrtBlockLinear) else target.model.config.hidden_size
            if linear is layer.down:
                k = target.model.config.intermediate_size
            dtype = getattr(linear, "act_dtype", torch.float32)
            assert rows_are_invariant(linear, k, dtype), type(linear).__name__
    finally:
        torch.set_num_threads(before)


@needs_ort
def test_ort_head_takes_q8_0_blocks_exactly():
    """Dequantized Q8_0 (d fp16 per 32 weights, q in -127..127, |q| = 127 somewhere in each
    block, as llama.cpp quantizes) comes back as the same q and d."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (48, 4, 32), generator=gen)
    q[:, :, 0] = 127 * torch.where(torch.rand(48, 4, generator=gen) < 0.5, -1, 1)
    d = (torch.rand(48, 4, generator=gen) * 0.01 + 1e-4).half().float()
    u, scale = quantize_symmetric((q * d[..., None]).reshape(48, 128), bits=8)
    assert torch.equal(scale, d)
    assert torch.equal(u.reshape(48, 4, 32).long() - 128, q)


@needs_ort
@pytest.mark.parametrize("bits", [8, 4])
def test_ort_linear_tracks_the_dense_product(bits):
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(80, 96, generator=gen) * 0.1, torch.randn(5, 96, generator=gen)
    y = OrtBlockLinear.from_float(w, bits=bits)(x)
    err = (y - x @ w.T).norm() / (x @ w.T).norm()
    assert err < (0.02 if bits == 8 else 0.2)


@pytest.mark.parametrize("drafter", ["ngram:min=1", "suffix"])
def test_speculative_equals_plain_greedy_on_both_paths(target, kernels, drafter):
    plain = Engine(target=target, drafter="none", backend="native")
    spec = Engine(target=target, drafter=drafter, k=4, backend="native")
    head = spec.backend.pool.model.lm_head
    assert isinstance(head, Int8Linear if kernels == "fallback" or not ort_available() else OrtBlockLinear)
    accepted = drafted = 0
    for prompt in ["def add(a, b):", "The quick brown fox", '{"name": "search"']:
        result = spec.generate(prompt, max_new_tokens=32, chat=False)
        assert result.token_ids == plain.generate(prompt, max_new_tokens=32, chat=False).token_ids
        accepted += result.stats.num_accepted_tokens
        drafted += result.stats.num_draft_tokens
    assert drafted > 0 and accepted > 0, "nothing drafted and accepted: the test would pass vacuously"


def test_chain_scoring_equals_one_token_steps(target, kernels):
    tokens = torch.randint(5, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    chain, steps = make_backend("native", target), make_backend("native", target)
    chain.prefill(tokens[:20])
    steps.prefill(tokens[:20])
    one_by_one = torch.cat([steps.forward([t]) for t in tokens[20:]])
    assert torch.equal(chain.forward(tokens[20:]), one_by_one)


def test_bad_lm_head_option_is_a_specdec_error(target):
    with pytest.raises(SpecdecError, match="unknown lm_head"):
        make_backend("native", target, lm_head="fp8")


def test_ort8_head_without_onnxruntime_is_a_specdec_error(target, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "fallback")
    with pytest.raises(SpecdecError, match="lm_head ort8 needs onnxruntime"):
        make_backend("native", target, lm_head="ort8")


@pytest.mark.slow
def test_real_model_head_is_the_gguf_q8_0_matrix(smollm2):
    """SmolLM2's tied embedding is Q8_0 in its GGUF: the 8-bit head holds those very blocks."""
    if not ort_available():
        pytest.skip("onnxruntime/onnx not installed")
    w = smollm2.model.get_output_embeddings().weight.detach()
    u, scale = quantize_symmetric(w, bits=8)
    assert torch.equal((u.float() - 128).reshape(w.shape[0], -1, 32) * scale[..., None],
                       w.reshape(w.shape[0], -1, 32))


# ---- quantized linears against their float references -------------------------------------


@pytest.mark.parametrize(("precision", "bound"), [
    ("bf16", 0.01),
    ("fp16", 0.002),
    ("int8", 0.02),
    ("int4", 0.15),
])
@pytest.mark.parametrize("rows", [48, 40])  # 40: int4 pads to a multiple of 16
def test_quantized_linear_error_is_bounded(precision, bound, rows):
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(rows, 64, generator=gen), torch.randn(5, 64, generator=gen)
    bias = torch.randn(rows, generator=gen)
    y = make_linear(w, bias, precision)(x)
    expected = F.linear(x, w, bias)
    assert y.shape == expected.shape and y.dtype == torch.float32
    assert (y - expected).norm() / expected.norm() < bound




# ---- eagerly in compiled graphs ------------------------------------------------------------------


def test_marked_methods_run_plain_until_a_compile_wraps_them(monkeypatch):
    from specdec.backends.native.kernels import cpu

    monkeypatch.setattr(cpu, "_MARKED", [])  # this test's own marks; the layers' stay as they are

    class Layer:
        @cpu.eager_in_graphs
        def forward(self, x):
            return x + 1

    assert not hasattr(Layer.forward, "_torchdynamo_disable") and Layer().forward(1) == 2
    cpu.disable_marked_in_graphs()
    cpu.disable_marked_in_graphs()  # once: not wrapped twice
    assert Layer.forward._torchdynamo_disable
    assert not hasattr(Layer.forward._torchdynamo_orig_callable, "_torchdynamo_disable")
    assert Layer().forward(1) == 2

    class Later:  # marked after compiling began: wrapped at once
        @cpu.eager_in_graphs
        def forward(self, x):
            return x

    assert Later.forward._torchdynamo_disable


def test_a_gguf_models_layers_call_their_kernels_eagerly_in_compiled_graphs(smollm2):
    """What NativeModel.compile does before tracing, on the embedded model's own types: each
    layer (PromptSame over a numba kernel, holding its bound method) now holds the wrapper."""
    from specdec.backends.native.kernels.int8_blocks import BlockLinear8, MixedBlockLinear8
    from specdec.backends.native.kernels.linear import PromptSame, bind_for_graphs
    from specdec.backends.native.kernels.precisions import FP16Linear
    from specdec.backends.native.model.backend import native_model_for

    modules = [m for layer in native_model_for(smollm2).layers for m in layer.modules()]
    held = [m for m in modules if isinstance(m, PromptSame)]
    assert held and all(isinstance(m.layer, (BlockLinear8, MixedBlockLinear8)) for m in held)
    bind_for_graphs(modules)
    assert all(m.forward._torchdynamo_disable for m in held)
    for layer in (BlockLinear8, MixedBlockLinear8, FP16Linear, OrtBlockLinear):
        assert layer.forward._torchdynamo_disable, layer.__name__
