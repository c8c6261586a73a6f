"""`auto`, the default backend: native where it runs the target's architecture, else hf.

The native backend runs the architectures of native/arch (SUPPORTED_TYPES) (GGUF files of llama,
mistral, qwen2, qwen3, gemma3 and phi3 read as they are) several times faster than
transformers on a CPU; everything else, and an HF config with a feature the native layers do
not compute (NativeConfig.from_hf refuses it by name), runs on transformers. `resolve_backend` decides from
the target's name before any weights load (a GGUF's architecture, a directory's
config.json), so that the CLI, bench reports and the server see the concrete backend; the
registered `auto` factory decides from a loaded target (its metadata) the same way. Falling
back to hf is never silent: a one-line notice names the architecture and the backend chosen.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specdec.backends import REGISTRY, Backend, register
from specdec.backends.native.model.config import SUPPORTED_TYPES, NativeConfig
from specdec.errors import SpecdecError
from specdec.gguf_file import MODEL_TYPES, gguf_file
from specdec.models import LoadedModel, resolve

log = logging.getLogger("specdec")


def resolve_backend(kind: str, target: str) -> str:
    """`kind`, with "auto" replaced by native or hf for the model `target` names."""
    if kind != "auto":
        return kind
    source, path = resolve(target)
    if source == "gguf":
        arch = gguf_file(path).meta("general.architecture")
        return _choose(MODEL_TYPES.get(arch, arch), target)
    try:
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return "hf"  # transformers reports what is wrong with the directory
    if model_type in SUPPORTED_TYPES:
        from transformers import AutoConfig

        return _native_or_hf(AutoConfig.from_pretrained(str(path), trust_remote_code=False), target)
    return _choose(model_type, target)


def backend_for(target: LoadedModel) -> str:
    """native or hf for a loaded target, from its metadata (no weights load)."""
    if target.gguf_path is None and target.model_type in SUPPORTED_TYPES:  # an HF config: check its features
        if target.model_loaded:
            return _native_or_hf(target.model.config, target.name)
        from transformers import AutoConfig

        return _native_or_hf(AutoConfig.from_pretrained(str(target.directory), trust_remote_code=False),
                             target.name)
    return _choose(target.model_type, target.name)


def _native_or_hf(config, name: str) -> str:
    """native where it computes every feature of a supported type's config; else hf, saying why."""
    try:
        NativeConfig.from_hf(config)
    except SpecdecError as e:
        log.warning("specdec: backend auto: %s runs on the hf backend (transformers): %s", name, e)
        return "hf"
    return "native"


def _choose(model_type: str | None, name: str) -> str:
    if model_type in SUPPORTED_TYPES:
        return "native"
    # with no handler configured, logging's last resort writes the warning to stderr
    log.warning("specdec: backend auto: the native backend does not run %r models (%s); using the hf "
                "backend (transformers)", model_type, name)
    return "hf"


@register("auto")
def _make(target, prefix_cache: str = "prompt", **options) -> Backend:
    return REGISTRY.lookup(backend_for(target))(target, prefix_cache, **options)
