"""The int8-activation weight kernels (kernels/int8_blocks.py) on synthetic blocks of every
quantized type of the table (quant_types.QUANTIZED), each test for both kernels (numba, and
the PyTorch replica):
- the integers and scales the kernels read reproduce the gguf package's reference weights
  bit for bit, and the outputs stay within the int8 activations' error bound of the exact
  dequantized product (a misplaced decoder breaks the bound);
- numba and the replica agree bit for bit, on each instruction path the CPU can run;
- rows are bit-identical whatever M (decode and prompt sizes) and at 1 or 2 threads;
- the layer keeps the file's bytes without copying them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specdec.backends.native.gguf.encode import quantize_blocks
from specdec.backends.native.gguf.layers import ReferenceLinear, head_from_quant, linear_from_quant
from specdec.backends.native.kernels import int8_blocks as k8
from specdec.backends.native.kernels import int8_ort, int8_reference, numba_ops, supertiles, tiles16
from specdec.backends.native.kernels.tiles16 import fields_at, repack, tile_bytes, unpack
from specdec.backends.native.quant_types import BLOCKS32, ORT_TYPES, QUANTIZED, Q, quant_type
from specdec.errors import SpecdecError
from specdec.gguf_file import QuantTensor

QTYPES = [t.name for t in QUANTIZED]
# the fp32 scale tables against the file's bytes: 4 (Q8_0, Q5_0) or 8 (Q5_1) bytes per block
KERNELS = ["numba", "torch"]
# the relative error of int8 activations with an outlier channel: about 1% per 32, 2% per 256
RELATIVE_ERROR = {32: 0.02, 256: 0.03}


def act_block(qtype: str) -> int:
    """llama.cpp's Q8_0 activations for the blocks of 32, its Q8_K for the super-blocks."""
    return quant_type(qtype).activation_block


def make_tensor(qtype: str, n: int = 40, k: int = 512, seed: int = 0) -> QuantTensor:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.2, 3, (n, 1)).astype(np.float32)
    ggml = GGMLQuantizationType[qtype]
    return QuantTensor(f"blk.0.{qtype}.weight", ggml, (n, k), quantize_blocks(w, ggml))


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 20  # an outlier channel, as real activations have
    return x


@pytest.fixture(params=KERNELS)
def kernel(request):
    if request.param == "numba" and not numba_ops.importable():
        pytest.skip("numba is not installed")
    return request.param


def error_bound(tensor: QuantTensor, x: torch.Tensor) -> torch.Tensor:
    """|y - x @ W.T| per output [M, N] from int8 activations: each element is off by at most
    half a step (max|x| of its activation block / 254: blocks of 32, the K-quants' of 256),
    plus fp32 accumulation slack."""
    span = act_block(tensor.qtype.name)
    w = torch.from_numpy(tensor.dequantize()).abs().reshape(tensor.shape[0], -1, span).sum(-1)  # [N, B]
    step = x.abs().reshape(x.shape[0], -1, span).amax(-1) / 254  # [M, B]
    magnitude = x.abs() @ torch.from_numpy(tensor.dequantize()).abs().T
    return step @ w.T * 1.001 + magnitude * 1e-5


def within_bound(layer, tensor: QuantTensor, x: torch.Tensor) -> bool:
    want = ReferenceLinear(tensor)(x)
    return bool(((layer(x) - want).abs() <= error_bound(tensor, x)).all())


@pytest.mark.parametrize("qtype", QTYPES)
def test_decoded_integers_are_the_reference_weights(qtype):
    tensor = make_tensor(qtype)
    layer = k8.BlockLinear8(tensor, kernel="torch")  # in tiles of 16 rows (kernels/tiles16.py, supertiles.py)
    np.testing.assert_array_equal(tile_weights(layer.tiles, qtype, *tensor.shape), tensor.dequantize())


@pytest.mark.parametrize("qtype", QTYPES)
def test_outputs_within_the_int8_activation_bound(qtype, kernel):
    tensor = make_tensor(qtype)
    layer = k8.BlockLinear8(tensor, kernel=kernel)
    x = activations(6, tensor.shape[1])
    assert within_bound(layer, tensor, x)
    # and the bound is tight enough to mean something
    want = ReferenceLinear(tensor)(x)
    assert ((layer(x) - want).norm() / want.norm()).item() < RELATIVE_ERROR[act_block(qtype)]


def misplaced_q6_k_values(b: np.ndarray) -> tuple:
    """A wrong Q6_K decoder: the high bit pairs taken in the reverse order."""
    ql = b[..., :128].reshape(*b.shape[:2], 2, 2, 32)
    qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)
    high = (qh >> (2 * np.arange(3, -1, -1, dtype=np.uint8))[:, None]) & 3
    q = ((low | (high << 4)).astype(np.float32) - 32).reshape(*b.shape[:2], 256)
    return q, b[..., 192:208].view(np.int8).astype(np.float32), None


def unspread_high_bits(qh: np.ndarray) -> np.ndarray:
    """A wrong Q5 repacking: the fifth bits left in the file's order (bit j for element j)."""
    return qh.copy()


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_0", "Q5_1"])
def test_a_misplaced_decoder_breaks_the_bound(monkeypatch, qtype):
    tensor = make_tensor(qtype)
    x = activations(4, tensor.shape[1])
    assert within_bound(k8.BlockLinear8(tensor, kernel="torch"), tensor, x)
    if qtype == "Q6_K":
        monkeypatch.setitem(int8_reference.SUPERBLOCK_VALUES, Q.Q6_K, misplaced_q6_k_values)
    else:
        monkeypatch.setattr(tiles16, "spread_high_bits", unspread_high_bits)
    assert not within_bound(k8.BlockLinear8(tensor, kernel="torch"), tensor, x)


@pytest.mark.parametrize("qtype", QTYPES)
def test_logits_keep_top1_and_kl(qtype, kernel):
    """A logits-like output (a vocabulary of 2000 rows): the argmax and the distribution of the
    int8-activation kernel against the exact dequantized product."""
    tensor = make_tensor(qtype, n=2000, k=256, seed=4)
    x = activations(16, 256, seed=5) * 0.1  # logits of std ~4, as a language model's
    got, want = k8.BlockLinear8(tensor, kernel=kernel)(x), ReferenceLinear(tensor)(x)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 15 / 16
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert kl.item() < (1e-3 if act_block(qtype) == 32 else 5e-3)  # one scale per 256 is coarser


@pytest.mark.parametrize("qtype", QTYPES)
# decode, a two-token chain, a batch, and 11 rows: a wide pass (8 rows with VNNI) then one of 4 with a repeat
@pytest.mark.parametrize("m", [1, 2, 5, 11])
@pytest.mark.parametrize("k", [512, 288])  # 288: an odd number of blocks of 32 (small-block kinds)
def test_numba_and_torch_kernels_agree_bit_for_bit(monkeypatch, qtype, m, k):
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(k8, "TORCH_TILE", 32)  # the replica's parts of 32 rows: 70 rows cross two seams
    if k % act_block(qtype):
        pytest.skip("the K-quants' rows are whole super-blocks of 256")
    tensor = make_tensor(qtype, n=70, k=k)  # not a multiple of the 16-row chunks, nor of the 4-row passes
    x = activations(m, tensor.shape[1])
    x[m // 2, : tensor.shape[1] // 2] = 0  # zero blocks: zero scales
    bias = torch.randn(70)
    got = k8.BlockLinear8(tensor, bias, kernel="numba")(x)
    assert torch.equal(got, k8.BlockLinear8(tensor, bias, kernel="torch")(x))


def q6k_extreme(n: int, k: int, q: int) -> QuantTensor:
    """Q6_K blocks whose every weight is q (0 or 63: q - 32 at either end) at the largest scale."""
    block = np.zeros(210, np.uint8)  # ql [128], qh [64], scales [16] int8, d fp16
    block[:128] = (q & 15) * 17
    block[128:192] = (q >> 4) * 0x55
    block[192:208] = 127
    block[208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return QuantTensor("blk.0.Q6_K.weight", GGMLQuantizationType.Q6_K, (n, k), np.tile(block, n * k // 256))


@pytest.mark.parametrize("q, sign", [(0, -1.0), (63, 1.0), (0, 1.0)])
def test_q6k_sums_at_their_extremes_stay_exact(q, sign):
    """Every product (q - 32) * xq at its largest, all of one sign: the AVX2 kernel's 16-bit pair
    sums (a sub-block's 8 products, less 32 times their xq) must still give the replica's bits."""
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    tensor = q6k_extreme(24, 512, q)
    assert np.all(tensor.dequantize() == np.float32(np.float16(0.01)) * 127 * (q - 32))
    x = torch.full((3, 512), sign)
    got = k8.BlockLinear8(tensor, kernel="numba")(x)
    assert torch.equal(got, k8.BlockLinear8(tensor, kernel="torch")(x))
    assert torch.allclose(got, ReferenceLinear(tensor)(x), rtol=1e-5)


DOT_CHECK = """
import numpy as np, torch
from specdec.backends.native.kernels.jit import ir
from specdec.backends.native.kernels import int8_blocks as k8
from tests.test_gguf_kernels_8bit import activations, make_tensor
assert ir.DOT == {dot!r}
for qtype, k in (("Q8_0", 288), ("Q5_0", 288), ("Q5_1", 288), ("Q4_0", 288), ("Q4_1", 288), ("Q6_K", 512),
                 ("Q5_K", 512), ("Q4_K", 512)):
    tensor, x = make_tensor(qtype, n=24, k=k), activations(11, k)
    for m in (1, 2, 5, 11):
        got = k8.BlockLinear8(tensor, kernel="numba")(x[:m])
        assert torch.equal(got, k8.BlockLinear8(tensor, kernel="torch")(x[:m])), (qtype, m)
"""


@pytest.mark.slow
def test_every_instruction_path_of_the_kernels_gives_the_replicas_bits():
    """vpdpbusd (VNNI), pmaddubsw (AVX2) and plain IR each compute the lanes' integers; each
    path this CPU can run, compiled in a process of its own, writes the replica's bits."""
    if not numba_ops.importable():
        pytest.skip("numba is not installed")
    from specdec.backends.native.kernels.jit import ir

    paths = ir.DOTS[ir.DOTS.index(ir.DOT) + 1 :]  # the default runs above
    for dot in paths:
        env = {**os.environ, "SPECDEC_INT8_DOT": dot}
        done = subprocess.run([sys.executable, "-c", DOT_CHECK.format(dot=dot)], env=env, capture_output=True,
                              text=True, cwd=Path(__file__).parent.parent, timeout=300)
        assert done.returncode == 0, f"{dot}: {done.stderr[-2000:]}"


def test_the_instruction_path_follows_the_cpu_features():
    from specdec.backends.native.kernels.jit.ir import dot_for

    assert dot_for("+avx2,+avx512bw,+avx512vnni,-amx-tile") == "vnni"
    assert dot_for("+avx2,+avx512bw,-avx512vnni") == "avx2"
    assert dot_for("+neon,+dotprod") == "generic"


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_do_not_depend_on_the_batch(qtype, kernel):
    tensor = make_tensor(qtype)
    layer = k8.BlockLinear8(tensor, kernel=kernel)
    x = activations(40, tensor.shape[1])  # 40: past the decode sizes, a prompt's
    alone = torch.cat([layer(x[i : i + 1].clone()) for i in range(9)])
    for m in (2, 3, 8, 9, 40):
        assert torch.equal(layer(x[:m].clone())[: min(m, 9)], alone[: min(m, 9)])


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_do_not_depend_on_the_thread_count(qtype, kernel):
    tensor = make_tensor(qtype, n=96)
    layer = k8.BlockLinear8(tensor, kernel=kernel)
    x = activations(33, tensor.shape[1])
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            if kernel == "numba":
                import numba

                numba_ops.numba_threads()  # sets the threading layer first
                numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
            outputs.append(layer(x))
    finally:
        torch.set_num_threads(threads)
        if kernel == "numba":
            import numba

            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("qtype", QTYPES)
def test_keeps_the_file_bytes_without_a_dense_copy(qtype):
    """Tiles of 16 rows: the blocks' bytes reordered (Q4_K's and Q5_K's six-bit fields as bytes,
    Q6_K's weights as whole bytes), no dense copy and nothing of the file's mapping kept."""
    tensor = make_tensor(qtype, n=64, k=1024)
    layer = k8.linear_for(tensor)
    qt = quant_type(qtype)
    per_tile = 1 if qt in BLOCKS32 else supertiles.tile_bytes(qt) / (16 * qt.block_bytes)
    growth = 4384 / 3360 if supertiles.whole_bytes(qt) else 1.03  # Q6_K: 8 bits a weight, not 6
    assert layer.nbytes() == tensor.data.nbytes * per_tile <= growth * tensor.data.nbytes
    assert not np.shares_memory(layer.tiles, tensor.data)
    assert layer.out_features == 64 and layer.act_dtype == torch.float32


def test_dtype_and_bias_and_bad_shapes():
    tensor = make_tensor("Q8_0")
    bias = torch.randn(40)
    x = activations(3, tensor.shape[1])
    layer = k8.BlockLinear8(tensor, bias, kernel="torch")
    assert torch.equal(layer(x), k8.BlockLinear8(tensor, kernel="torch")(x) + bias)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
    odd = QuantTensor("blk.0.odd.weight", GGMLQuantizationType.Q6_K, (2, 288), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match="blk.0.odd.weight"):
        k8.BlockLinear8(odd)
    with pytest.raises(ValueError, match="Q2_K"):
        k8.BlockLinear8(QuantTensor("t", GGMLQuantizationType.Q2_K, (1, 256), np.zeros((1, 84), np.uint8)))


def test_fallback_is_forced_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "fallback")
    assert k8.kernel_name() == "torch"
    assert k8.linear_for(make_tensor("Q5_K")).kernel == "torch"
    monkeypatch.delenv("SPECDEC_CPU_KERNELS")
    assert k8.kernel_name() == ("numba" if numba_ops.importable() else "torch")


@pytest.mark.parametrize("qtype", [t.name for t in BLOCKS32])
@pytest.mark.parametrize("n, k", [(16, 32), (70, 288), (5, 512)])
def test_tiles_hold_the_blocks_of_16_rows(monkeypatch, qtype, n, k):
    """Tile t, block b, vector v, lane r: row 16 t + r's qs[4 v .. 4 v + 3] (nibbles, or Q8_0's
    int8); for Q5 a vector of the rows' fifth bits; then the rows' d (and m); rows past N zero.
    Unpacking gives the file's weights back. Repacked two tiles at a time here, so the parts' seams
    are crossed."""
    tensor, qt = make_tensor(qtype, n=n, k=k), quant_type(qtype)
    monkeypatch.setattr(tiles16, "REPACK_TILES", 2)
    tiles = repack(tensor.data, qt, n, k)
    width, file_width = tile_bytes(qt), qt.block_bytes
    assert tiles.shape == (-(-n // 16), k // 32 * width) and not tiles.flags.writeable
    blocks = np.asarray(tensor.data).reshape(n, k // 32, file_width)
    first, qs_at = tiles[0, :width], file_width - qt.qs_bytes
    # v 1, lane 3
    assert bytes(first[64 + 4 * 3 : 64 + 4 * 3 + 4]) == bytes(blocks[3, 0, qs_at + 4 : qs_at + 8])
    at = fields_at(qt)
    assert bytes(first[at + 2 * 2 : at + 2 * 3]) == bytes(blocks[2, 0, :2])  # row 2's d
    if qt.high_bits:  # lane 1 of the fifth bits: bit g of byte c is element 4 g + c's
        spread = int.from_bytes(bytes(first[256 + 4 : 256 + 8]), "little")
        qh = int.from_bytes(bytes(blocks[1, 0, qs_at - 4 : qs_at]), "little")
        assert all((spread >> (8 * c + g) & 1) == (qh >> (4 * g + c) & 1) for g in range(8) for c in range(4))
    np.testing.assert_array_equal(tile_weights(tiles, qtype, n, k), tensor.dequantize())


def tile_weights(tiles: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The weights tiles hold [N, K]: (q - offset) d, or q d + m, as gguf dequantizes them; a
    K-quant's (d sc) q - dmin m."""
    if quant_type(qtype) not in BLOCKS32:
        q, sc, mn, d, dmin = supertiles.unpack(tiles, qtype, n, k)
        w = np.repeat(d[..., None] * sc, 256 // sc.shape[-1], -1) * q
        return (w if mn is None else w - np.repeat(dmin[..., None] * mn, 32, -1)).reshape(n, k)
    q, d, m = unpack(tiles, qtype, n, k)
    q = q.astype(np.float32)
    w = (q - quant_type(qtype).offset) * d[..., None] if m is None else d[..., None] * q + m[..., None]
    return w.reshape(n, k)


@pytest.mark.parametrize("qtype", ["Q5_K", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q4_K"])
def test_reference_dequantize_matches_gguf(qtype):
    """The fixture's blocks are what the gguf package decodes (a guard on make_tensor itself)."""
    tensor = make_tensor(qtype, n=4)
    np.testing.assert_array_equal(tensor.dequantize(), dequantize(tensor.data, tensor.qtype).reshape(4, 512))


@pytest.mark.parametrize("qtype", QTYPES)
def test_reads_a_read_only_mapping(qtype, kernel):
    """GGUFReader maps the file read-only; the kernels take those bytes as they are."""
    tensor = make_tensor(qtype, n=24)
    writable = k8.BlockLinear8(tensor, kernel=kernel)(activations(2, 512))
    tensor.data.setflags(write=False)
    assert torch.equal(k8.BlockLinear8(tensor, kernel=kernel)(activations(2, 512)), writable)


# ---- the LM head on ONNX Runtime (gguf/layers.head_from_quant, lm_head ort8) ----------------------


@pytest.fixture
def ort8():
    if not int8_ort.ort_8bit_usable():
        pytest.skip("onnxruntime is not installed, or its 8-bit kernel is not batch-invariant here")


@pytest.mark.parametrize("qtype", [t.name for t in ORT_TYPES])
def test_an_ort8_head_holds_the_files_weights_with_rows_independent(ort8, qtype):
    tensor = make_tensor(qtype, n=64, k=512)
    layer = head_from_quant(tensor, "ort8")
    x = activations(9, 512)
    assert within_bound(layer, tensor, x)  # int8 activations of exact weights; a wrong scale breaks it
    batch = layer(x)
    for i in (0, 4, 8):
        assert torch.equal(layer(x[i : i + 1])[0], batch[i])


@pytest.mark.parametrize(("qtype", "kind", "message"), [
    ("Q8_0", "int4", "lm_head 'int4' requantizes a float head"),
    ("Q5_K", "ort8", "Q5_K"),
])
def test_a_gguf_head_refuses_what_it_cannot_run_by_name(qtype, kind, message):
    with pytest.raises(SpecdecError, match=message):
        head_from_quant(make_tensor(qtype, n=8, k=256), kind)


def test_the_default_head_is_the_files_own_kernel():
    assert isinstance(head_from_quant(make_tensor("Q8_0", n=8, k=256)).layer, k8.BlockLinear8)


@pytest.mark.parametrize("types, shared", [(("Q5_0", "Q5_0", "Q8_0"), True), (("Q5_1", "Q8_0"), True),
                                           (("Q6_K", "Q5_K"), True), (("Q8_0", "Q6_K"), False)])
def test_mixed_8bit_types_share_one_quantization_of_the_input(types, shared, kernel, monkeypatch):
    """A Q4_K_M file's Q5_0 q and k beside its Q8_0 v: one layer that quantizes the input once
    and writes each part's columns, bit for bit what each part computes alone (biases
    included), at one row (decode) and at several. Blocks of 32 beside super-blocks of 256
    read two activation formats: separate parts."""
    monkeypatch.setattr("specdec.backends.native.kernels.int8_blocks.kernel_name", lambda: kernel)
    parts = [make_tensor(t, n, 512, seed=i)
             for i, (t, n) in enumerate(zip(types, (96, 64, 32)[: len(types)], strict=True))]
    biases = [torch.randn(96), None, torch.randn(32)][: len(parts)]
    fused = linear_from_quant(parts, biases)
    assert ((fused.fused is not None) == shared
            and isinstance(getattr(fused.fused, "layer", None), k8.MixedBlockLinear8) == shared)
    for m in (1, 5):
        x = activations(m, 512)
        alone = [linear_from_quant(t, b)(x) for t, b in zip(parts, biases, strict=True)]
        assert torch.equal(fused.joined(x), torch.cat(alone, dim=-1)), m
        assert all(torch.equal(got, want) for got, want in zip(fused(x), alone, strict=True))
