"""The GGUF quant types the native backend reads: one record per type, the one table.

Every per-type fact the backend uses is a field of a `QuantType` or derived from the table:
block sizes and bytes, which kernel family runs the type, the code its numba kernels dispatch
on, the layout of its blocks of 32, where its fp16 scales sit. Code passes the records (or the
gguf package's `GGMLQuantizationType`, which `quant_type` turns into one), never type names.

Adding a type is one record here plus its kernel:
- a block-of-32 type whose weights are d (q - offset) or d q + m with 4, 5 or 8 bits (the
  fields below) needs no new kernel code: kernels/tiles16.py repacks it and
  kernels/jit/tiles16.py builds its tile kernel from the record;
- a super-block type needs its decoder in kernels/int8_reference.py (`SUPERBLOCK_VALUES`), its
  tile layout in kernels/supertiles.py and its weights' reader in kernels/jit/supertiles.py
  (`_group`);
- gguf/encode.py needs an encoder where the gguf package has none.
tests/test_quant_types.py walks the table and checks that each type has all of these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specdec.errors import SpecdecError

Q = GGMLQuantizationType


class Family(enum.Enum):
    """Which layers run a type (gguf/layers.py dispatches on it)."""

    FLOAT = "float"  # F32, F16, BF16: float layers over the file's own tensor
    BLOCKS32 = "blocks32"  # blocks of 32: tiles of 16 rows, int8 activations per block of 32
    SUPERBLOCKS = "superblocks"  # K-quants: the file's super-blocks of 256, int8 activations per 256


@dataclass(frozen=True)
class QuantType:
    ggml: GGMLQuantizationType
    family: Family
    block: int  # weights per block (1 for the float types)
    block_bytes: int  # bytes per block
    code: int = -1  # the index the family's numba kernels dispatch on
    scales_at: tuple[int, ...] = ()  # byte offsets of the block's fp16 scales: d, then m or dmin
    # w = d (q - offset), or with a min term (`with_min`: d q + m; the K-quants: - dmin m).
    # Blocks of 32: q from `qs_bytes` of nibbles
    # (16) or int8 (32), plus a fifth bit per weight where `high_bits`
    qs_bytes: int = 0
    high_bits: bool = False
    with_min: bool = False
    offset: int = 0
    four_bit: bool = False  # runs PyTorch's int4 kernel where numba does not run
    sub_block: int = 0  # K-quants: weights per sub-block scale
    q_bits: int = 0  # K-quants: the bits of each weight's integer q (4 as nibbles, the rest as high bits)
    ort_block: int | None = None  # MatMulNBits' block where ONNX Runtime holds the weights exactly

    @property
    def name(self) -> str:
        return self.ggml.name

    @property
    def activation_block(self) -> int:
        """The span its int8 activations are quantized over: a block of 32 or a super-block."""
        return 256 if self.family is Family.SUPERBLOCKS else 32

    def __repr__(self) -> str:
        return f"QuantType({self.name})"


TABLE: tuple[QuantType, ...] = (
    QuantType(Q.F32, Family.FLOAT, 1, 4),
    QuantType(Q.F16, Family.FLOAT, 1, 2),
    QuantType(Q.BF16, Family.FLOAT, 1, 2),
    QuantType(Q.Q4_0, Family.BLOCKS32, 32, 18, code=0, scales_at=(0,), qs_bytes=16, offset=8, four_bit=True),
    QuantType(Q.Q4_1, Family.BLOCKS32, 32, 20, code=1, scales_at=(0, 2), qs_bytes=16, with_min=True,
              four_bit=True),
    QuantType(Q.Q5_0, Family.BLOCKS32, 32, 22, code=2, scales_at=(0,), qs_bytes=16, high_bits=True, offset=16,
              ort_block=32),
    QuantType(Q.Q5_1, Family.BLOCKS32, 32, 24, code=3, scales_at=(0, 2), qs_bytes=16, high_bits=True,
              with_min=True),
    QuantType(Q.Q8_0, Family.BLOCKS32, 32, 34, code=4, scales_at=(0,), qs_bytes=32, ort_block=32),
    QuantType(Q.Q6_K, Family.SUPERBLOCKS, 256, 210, code=0, scales_at=(208,), ort_block=16, sub_block=16,
              q_bits=6),
    QuantType(Q.Q5_K, Family.SUPERBLOCKS, 256, 176, code=1, scales_at=(0, 2), with_min=True, sub_block=32,
              q_bits=5),
    QuantType(Q.Q4_K, Family.SUPERBLOCKS, 256, 144, code=2, scales_at=(0, 2), with_min=True, four_bit=True,
              sub_block=32, q_bits=4),
)

BY_GGML: dict[GGMLQuantizationType, QuantType] = {t.ggml: t for t in TABLE}


def family(kind: Family) -> tuple[QuantType, ...]:
    """The family's types in the order of their codes."""
    return tuple(sorted((t for t in TABLE if t.family is kind), key=lambda t: t.code))


BLOCKS32 = family(Family.BLOCKS32)
SUPERBLOCKS = family(Family.SUPERBLOCKS)
QUANTIZED = BLOCKS32 + SUPERBLOCKS  # the types the int8-activation kernels read
ORT_TYPES = tuple(t for t in TABLE if t.ort_block is not None)
SUPPORTED_NAMES = tuple(t.name for t in TABLE)


def quant_type(qtype: GGMLQuantizationType | QuantType | str) -> QuantType:
    """The record of a type given as the gguf enum, a record, or a name (tests, options)."""
    if isinstance(qtype, QuantType):
        return qtype
    ggml = Q[qtype] if isinstance(qtype, str) and qtype in Q.__members__ else qtype
    if ggml not in BY_GGML:
        name = getattr(ggml, "name", ggml)
        raise SpecdecError(f"GGUF type {name} is not read by the native backend (it reads "
                           f"{', '.join(SUPPORTED_NAMES)})", "target")
    return BY_GGML[ggml]


def check_type(name: str, qtype: GGMLQuantizationType) -> QuantType:
    """The record of tensor `name`'s type, or a one-line error naming the types read."""
    if qtype not in BY_GGML:
        raise SpecdecError(f"tensor {name!r} has GGUF type {qtype.name}, "
                           "which the native backend does not read "
                           f"(it reads {', '.join(SUPPORTED_NAMES)})", "target")
    return BY_GGML[qtype]


def _check_table() -> None:
    for t in TABLE:  # the gguf package's own sizes, so a record cannot drift from the format
        if GGML_QUANT_SIZES[t.ggml] != (t.block, t.block_bytes):
            raise AssertionError(f"{t.name}: {t.block}/{t.block_bytes} against {GGML_QUANT_SIZES[t.ggml]}")
    for kind in (Family.BLOCKS32, Family.SUPERBLOCKS):
        if [t.code for t in family(kind)] != list(range(len(family(kind)))):
            raise AssertionError(f"{kind}: codes must be 0..n-1")


_check_table()
