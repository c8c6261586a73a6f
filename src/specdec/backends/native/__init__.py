"""The native backend: a lean PyTorch Llama-family model over a static, slotted KV cache.

quant_types.py is the one table of GGUF quant types; gguf/ reads a file and builds layers over
its blocks; kernels/ holds the linear layers, attention and the numba code; model/ the layers,
the forward, the cache pool and one sequence (the `Backend`); arch/ each architecture's
differences. docs/architecture.md has the module map.
"""

from __future__ import annotations

from specdec.backends import register
from specdec.backends.native.model.backend import NATIVE_OPTIONS, make_native_backend
from specdec.backends.native.model.sequence import NativeSequence
from specdec.errors import SpecdecError


@register("native")
def _make(target, prefix_cache: str = "prompt", **options) -> NativeSequence:
    unknown = sorted(set(options) - set(NATIVE_OPTIONS))
    if unknown:
        raise SpecdecError(
            f"unknown native backend option(s) {', '.join(unknown)}; "
            f"known: {', '.join(NATIVE_OPTIONS)}", "backend"
        )
    return make_native_backend(target, prefix_cache, **options)
