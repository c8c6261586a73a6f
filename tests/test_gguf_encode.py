"""Our K-quant encoders (gguf/encode.py) against the gguf package's reference decoder: the
decoded weights are close to the floats encoded, and blocks whose scales the encoder must
choose as they are (each sub-block spans its full range, the largest scale at its maximum)
come back byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specdec.backends.native.gguf.encode import QK_K, pack_scale_min, quantize_blocks

# relative Frobenius error of gaussian weights through each format (min/max scales)
BOUNDS = {"Q4_K": 0.10, "Q5_K": 0.05, "Q6_K": 0.025, "Q8_0": 0.01}


def decode(blocks: np.ndarray, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    return dequantize(blocks, GGMLQuantizationType[qtype]).reshape(shape)


@pytest.mark.parametrize("qtype", list(BOUNDS))
@pytest.mark.parametrize("spread", [1.0, 1e-3, 40.0])
def test_decoded_weights_are_close(qtype, spread):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((24, 3 * QK_K)) * spread).astype(np.float32)
    x[3] += 5 * spread  # a row that is all positive: K-quants' minimum clamps at 0
    blocks = quantize_blocks(x, GGMLQuantizationType[qtype])
    assert blocks.dtype == np.uint8 and blocks.shape[0] == 24
    got = decode(blocks, qtype, x.shape)
    assert np.linalg.norm(got - x) / np.linalg.norm(x) < BOUNDS[qtype]


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_zero_and_constant_rows(qtype):
    x = np.zeros((2, QK_K), np.float32)
    x[1] = -0.5
    got = decode(quantize_blocks(x, GGMLQuantizationType[qtype]), qtype, x.shape)
    np.testing.assert_array_equal(got[0], 0)
    np.testing.assert_allclose(got[1], -0.5, rtol=2e-3)


def test_rows_must_hold_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_blocks(np.zeros((2, 288), np.float32), GGMLQuantizationType.Q6_K)


def canonical_q4_q5(rng, blocks: int, levels: int) -> np.ndarray:
    """Fields of Q4_K/Q5_K blocks the encoder must reproduce: [B, 256] q, sc/m with the
    largest at 63, every sub-block holding q = 0 and q = levels; returns the packed bytes."""
    d = rng.uniform(0.01, 1, blocks).astype(np.float16)
    dmin = rng.uniform(0.01, 1, blocks).astype(np.float16)
    sc = rng.integers(1, 64, (blocks, 8)).astype(np.uint8)
    m = rng.integers(0, 64, (blocks, 8)).astype(np.uint8)
    sc[:, 0], m[:, 1] = 63, 63
    q = rng.integers(0, levels + 1, (blocks, 8, 32)).astype(np.uint8)
    q[:, :, 0], q[:, :, 1] = 0, levels
    head = [d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), pack_scale_min(sc, m)]
    low = (q & 0x0F).reshape(blocks, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(blocks, 128)
    if levels == 15:
        return np.concatenate([*head, nibbles], axis=1)
    qh = np.zeros((blocks, 32), np.uint8)
    for i in range(8):
        qh |= ((q[:, i] >> 4) & 1) << i
    return np.concatenate([*head, qh, nibbles], axis=1)


def canonical_q6(rng, blocks: int) -> np.ndarray:
    """Q6_K blocks the encoder must reproduce: one scale at -128, and every sub-block's
    largest magnitude at q - 32 = -32."""
    d = rng.uniform(1e-3, 0.1, blocks).astype(np.float16)
    sc = rng.integers(-127, 128, (blocks, 16)).astype(np.int8)
    sc[sc == 0] = 1
    sc[:, 5] = -128
    q = rng.integers(1, 64, (blocks, 16, 16)).astype(np.uint8)
    q[:, :, 3] = 0
    q = q.reshape(blocks, 2, 4, 32)
    ql = ((q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)).reshape(blocks, 128)
    high = q >> 4
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(blocks, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d[:, None].view(np.uint8)], axis=1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_canonical_blocks_round_trip_byte_for_byte(qtype):
    rng = np.random.default_rng(11)
    rows, per_row = 6, 4
    if qtype == "Q6_K":
        blocks = canonical_q6(rng, rows * per_row)
    else:
        blocks = canonical_q4_q5(rng, rows * per_row, 15 if qtype == "Q4_K" else 31)
    blocks = blocks.reshape(rows, -1)
    weights = decode(blocks, qtype, (rows, per_row * QK_K))
    np.testing.assert_array_equal(quantize_blocks(weights, GGMLQuantizationType[qtype]), blocks)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_encoding_decoded_weights_again_keeps_them(qtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 2 * QK_K)).astype(np.float32)
    once = decode(quantize_blocks(x, GGMLQuantizationType[qtype]), qtype, x.shape)
    twice = decode(quantize_blocks(once, GGMLQuantizationType[qtype]), qtype, x.shape)
    np.testing.assert_array_equal(twice, once)


@pytest.mark.slow
def test_synthetic_qwen2_script_writes_a_q4_k_m_mix(tmp_path):
    """scripts/bench/synthetic_qwen2_gguf.py at a tiny size: llama.cpp's Q4_K_M mix of types, the
    embedded model's vocabulary, weights that decode to the random scale."""
    import importlib.util
    from pathlib import Path

    from gguf import GGUFReader

    spec = importlib.util.spec_from_file_location(
        "synthetic_qwen2_gguf",
        Path(__file__).parent.parent / "scripts" / "bench" / "synthetic_qwen2_gguf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "tiny.gguf"
    script.write(str(out), layers=3, hidden=256, ffn=512, heads=4, kv_heads=2, seed=0)
    reader = GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == "qwen2"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert types["token_embd.weight"] == "Q6_K" and types["blk.1.attn_q.weight"] == "Q4_K"
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(3)] == ["Q4_K", "Q4_K", "Q6_K"]
    assert types["blk.0.attn_q.bias"] == "F32"
    q = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate.weight")
    assert abs(float(np.std(dequantize(q.data, q.tensor_type))) - 0.02) < 0.002
