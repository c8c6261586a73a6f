"""The native backend: a lean PyTorch Llama-family model over a static, slotted KV cache."""

from __future__ import annotations

from specdec.backends import register
from specdec.backends.native.model import NATIVE_OPTIONS, make_native_backend
from specdec.errors import SpecdecError


@register("native")
def _make(target, **options):
    unknown = sorted(set(options) - set(NATIVE_OPTIONS))
    if unknown:
        raise SpecdecError(
            f"unknown native backend option(s) {', '.join(unknown)}; known: {', '.join(NATIVE_OPTIONS)}", "backend"
        )
    return make_native_backend(target, **options)
