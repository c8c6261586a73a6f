"""`auto`, the default backend: native where it runs the target's architecture, else hf.

The native backend runs Llama-family models (layer.SUPPORTED_TYPES) about twice as fast as
transformers on a CPU; everything else runs on transformers. `resolve_backend` decides from
the target's name before any weights load (a GGUF's architecture, a directory's
config.json), so that the CLI, bench reports and the server see the concrete backend; the
registered `auto` factory decides from a loaded target the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf import GGUFReader

from specdec.backends import REGISTRY, Backend, register
from specdec.backends.native.layer import SUPPORTED_TYPES
from specdec.models import resolve

NATIVE_GGUF_ARCHITECTURES = ("llama", "qwen2")  # what transformers converts to SUPPORTED_TYPES


def resolve_backend(kind: str, target: str) -> str:
    """`kind`, with "auto" replaced by native or hf for the model `target` names."""
    if kind != "auto":
        return kind
    source, path = resolve(target)
    if source == "gguf":
        return "native" if _gguf_architecture(path) in NATIVE_GGUF_ARCHITECTURES else "hf"
    try:
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return "hf"  # transformers reports what is wrong with the directory
    return "native" if model_type in SUPPORTED_TYPES else "hf"


def backend_for(target) -> str:
    """native or hf for a loaded target (a LoadedModel)."""
    model_type = getattr(getattr(target.model, "config", None), "model_type", None)
    return "native" if model_type in SUPPORTED_TYPES else "hf"


def _gguf_architecture(path) -> str | None:
    field = GGUFReader(str(path)).fields.get("general.architecture")
    return None if field is None else field.contents()


@register("auto")
def _make(target, prefix_cache: str = "prompt", **options) -> Backend:
    return REGISTRY.lookup(backend_for(target))(target, prefix_cache, **options)
