"""The native backend: a lean PyTorch Llama-family model over a static, slotted KV cache.

layer.py holds one decoder layer and its attention, cache.py the slotted KV cache and the
`Backend` over one slot, model.py the weights and the forward, quant.py the linear kernels
and gguf.py the GGUF reader.
"""

from __future__ import annotations

from specdec.backends import register
from specdec.backends.native.cache import NativeSequence
from specdec.backends.native.model import NATIVE_OPTIONS, make_native_backend
from specdec.errors import SpecdecError


@register("native")
def _make(target, prefix_cache: str = "prompt", **options) -> NativeSequence:
    unknown = sorted(set(options) - set(NATIVE_OPTIONS))
    if unknown:
        raise SpecdecError(
            f"unknown native backend option(s) {', '.join(unknown)}; known: {', '.join(NATIVE_OPTIONS)}", "backend"
        )
    return make_native_backend(target, prefix_cache, **options)
