"""`auto`, the default backend: native where it runs the target's architecture, else hf.

The native backend runs llama, mistral, qwen2, qwen3, gemma3 and phi3 (layer.SUPPORTED_TYPES)
about twice as fast as transformers on a CPU; everything else, and a supported type with a
feature the native layers do not compute (NativeConfig.from_hf refuses it by name), runs on
transformers, with a warning that says why. `resolve_backend` decides from the target's name
before any weights load (a GGUF's architecture, a directory's config), so that the CLI, bench
reports and the server see the concrete backend; the registered `auto` factory decides from
a loaded target the same way.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gguf import GGUFReader

from specdec.backends import REGISTRY, Backend, register
from specdec.backends.native.layer import SUPPORTED_TYPES, NativeConfig
from specdec.errors import SpecdecError
from specdec.models import resolve

log = logging.getLogger("specdec")

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
    if model_type not in SUPPORTED_TYPES:
        return "hf"
    from transformers import AutoConfig

    return _native_or_hf(AutoConfig.from_pretrained(str(path), trust_remote_code=False), target)


def backend_for(target) -> str:
    """native or hf for a loaded target (a LoadedModel)."""
    config = getattr(target.model, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED_TYPES:
        return "hf"
    return _native_or_hf(config, target.name)


def _native_or_hf(config, name: str) -> str:
    """native where it computes every feature of a supported type's config; else hf, saying why."""
    try:
        NativeConfig.from_hf(config)
    except SpecdecError as e:
        log.warning("backend auto: %s runs on hf: %s", name, e)
        return "hf"
    return "native"


def _gguf_architecture(path) -> str | None:
    field = GGUFReader(str(path)).fields.get("general.architecture")
    return None if field is None else field.contents()


@register("auto")
def _make(target, prefix_cache: str = "prompt", **options) -> Backend:
    return REGISTRY.lookup(backend_for(target))(target, prefix_cache, **options)
