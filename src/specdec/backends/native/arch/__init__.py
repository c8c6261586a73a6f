"""The architectures the native backend runs, one module each (its differences from the
defaults of base.py), and the registry the readers look them up in.

Adding an architecture: a module here with its `Architecture` subclass, its line in
`ARCHITECTURES`, and its GGUF name in specdec.gguf_file.MODEL_TYPES.
"""

from __future__ import annotations

from specdec.backends.native.arch.base import Architecture
from specdec.backends.native.arch.gemma3 import Gemma3
from specdec.backends.native.arch.llama import Llama, Qwen2
from specdec.backends.native.arch.phi3 import Phi3
from specdec.backends.native.arch.qwen3 import Qwen3

ARCHITECTURES: tuple[Architecture, ...] = (Llama(), Qwen2(), Qwen3(), Gemma3(), Phi3())
BY_GGUF = {a.gguf_name: a for a in ARCHITECTURES}
BY_MODEL_TYPE = {t: a for a in ARCHITECTURES for t in a.model_types}
SUPPORTED_TYPES = tuple(BY_MODEL_TYPE)  # the Hugging Face model types the native backend runs
