"""The quant-type table (backends/native/quant_types.py) walked type by type: every record has
a reader (the file's bytes come back as a QuantTensor of that type), an encoder for the tests
(gguf/encode.py), a reference dequantizer (the gguf package's), and a kernel whose layer
reproduces the reference product within its documented bound; and the per-type parts of the
kernels (the tile layout, the super-block readers and decoders) cover the table exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter

from specdec.backends.native.gguf.encode import quantize_blocks
from specdec.backends.native.gguf.layers import ReferenceLinear, linear_from_quant, runs_int8_activations
from specdec.backends.native.kernels import int8_reference, supertiles
from specdec.backends.native.kernels.tiles16 import tile_bytes
from specdec.backends.native.quant_types import (
    BLOCKS32,
    SUPERBLOCKS,
    TABLE,
    Family,
    Q,
    QuantType,
    check_type,
    quant_type,
)
from specdec.errors import SpecdecError
from specdec.gguf_file import GGUFFile, QuantTensor

N, K = 48, 512


def weights(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((N, K)) * rng.uniform(0.2, 2, (N, 1))).astype(np.float32)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[np.ndarray, QuantTensor]]:
    """One file holding a matrix of every type of the table, as encoded, and as read back."""
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    encoded = {}
    for qt in TABLE:
        encoded[qt.name] = quantize_blocks(weights(), qt.ggml)
        writer.add_tensor(f"{qt.name}.weight", encoded[qt.name], raw_dtype=qt.ggml)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    return {name: (raw, f.tensors[f"{name}.weight"]) for name, raw in encoded.items()}


@pytest.mark.parametrize("qt", TABLE, ids=lambda t: t.name)
def test_every_type_has_a_reader_an_encoder_and_a_reference(qt: QuantType, written):
    raw, tensor = written[qt.name]
    assert tensor.qtype is qt.ggml and tensor.shape == (N, K)
    assert np.asarray(tensor.data).tobytes() == np.asarray(raw).tobytes()  # the file's bytes, unchanged
    reference = tensor.dequantize()  # the gguf package's decoder
    error = np.linalg.norm(reference - weights()) / np.linalg.norm(weights())
    assert error < 0.2, error  # the encoder wrote these weights, to the type's precision


@pytest.mark.parametrize("qt", TABLE, ids=lambda t: t.name)
def test_every_type_has_a_kernel_within_its_bound(qt: QuantType, written):
    _, tensor = written[qt.name]
    layer = linear_from_quant(tensor)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    want = ReferenceLinear(tensor)(x)
    error = float((layer(x) - want).norm() / want.norm())
    # F32, F16: rounding only; BF16 and bf16 scales: below 1%; int8 activations: 1% per 32, 2% per 256
    bound = 1e-5 if qt.ggml is not Q.BF16 else 0.01  # BF16: bf16 activations
    if qt.family is not Family.FLOAT:
        bound = 0.03 if runs_int8_activations(qt) else 0.01
    assert error < bound, (qt.name, error)


def test_the_records_agree_with_the_gguf_package():
    for qt in TABLE:
        assert GGML_QUANT_SIZES[qt.ggml] == (qt.block, qt.block_bytes)
        assert quant_type(qt.ggml) is qt and quant_type(qt.name) is qt and quant_type(qt) is qt
        assert check_type("w", qt.ggml) is qt
    assert [t.code for t in BLOCKS32] == list(range(len(BLOCKS32)))
    assert [t.code for t in SUPERBLOCKS] == list(range(len(SUPERBLOCKS)))


def test_the_kernels_per_type_parts_cover_the_table():
    """A block-of-32 type is described by its record alone (the tile kernel is built from it);
    a super-block type needs its decoder here and its tile layout (kernels/supertiles.py)."""
    for qt in BLOCKS32:
        assert qt.qs_bytes in (16, 32) and len(qt.scales_at) == 1 + qt.with_min
        assert tile_bytes(qt) % 32 == 0
    assert set(int8_reference.SUPERBLOCK_VALUES) == {qt.ggml for qt in SUPERBLOCKS}
    for qt in SUPERBLOCKS:
        assert qt.sub_block in (16, 32) and 4 <= qt.q_bits <= 6 and supertiles.tile_bytes(qt) % 32 == 0
        # the file's bytes in another order, six-bit scales and mins as bytes; Q6_K's weights
        # as whole bytes (8 bits a weight where the file has 6)
        growth = 8 / 6 if supertiles.whole_bytes(qt) else 1.03
        assert 16 * qt.block_bytes <= supertiles.tile_bytes(qt) <= growth * 16 * qt.block_bytes


def test_a_type_outside_the_table_is_refused_by_name():
    from gguf import GGMLQuantizationType

    with pytest.raises(SpecdecError, match="Q2_K.*it reads F32, F16, BF16"):
        check_type("blk.0.attn_q.weight", GGMLQuantizationType.Q2_K)
    with pytest.raises(SpecdecError, match="IQ4_NL"):
        quant_type("IQ4_NL")
