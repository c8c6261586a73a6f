"""Encoding floats into GGUF block formats, for synthetic model files (tests, scripts).

The gguf package quantizes F32/F16/BF16/Q8_0/Q4_0/Q4_1 itself; the K-quants (Q4_K, Q5_K,
Q6_K) are encoded here. An encoder need not be optimal, only valid: the gguf package's
`dequantize` of its bytes is the model's weights.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants


def quantize_blocks(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """x [N, K] fp32 -> the file's bytes for `qtype`: [N, bytes per row] uint8 for block
    types, [N, K] of the float type otherwise."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
        raise NotImplementedError(f"encoding {qtype.name} is not written yet")
    return gguf_quants.quantize(x, qtype)
