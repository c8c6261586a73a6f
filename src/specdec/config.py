"""`EngineConfig`: the settings of a speculative engine, one object for every entry point.

`Engine`, the server's scheduler and `specdec generate | bench | serve | distill` all take an
EngineConfig. A config file (`--config FILE`, YAML) holds its keys at the top level; command
line flags override it. Keys, with the aliases a file may use instead:

    target           score_model, model (the target, as a vLLM config file means it)
    drafter          propose_model, or vLLM's speculative_config (method, model, prompt_lookup_*)
    k                num_propose_tokens, num_speculative_tokens
    backend, backend_options, prefix_cache, draft_device, verify_strategy

vLLM's keys may also sit under `speculative_config:`, where `model` is the draft. A file's
`serve:` mapping belongs to `specdec serve` (serve/cli.py) and is skipped here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specdec.backends.prefix_cache import prefix_cache_mode
from specdec.drafters import DrafterSpec
from specdec.errors import SpecdecError
from specdec.models import DEFAULT_TARGET
from specdec.sampling import SamplingParams

MAX_K = 64  # the longest fixed draft anyone may ask for, server clients included
# rejection: lossless speculative sampling (Leviathan et al.), which at temperature 0 is exact
#   argmax matching; greedy: decode greedily whatever the sampling parameters ask for.
VERIFY_STRATEGIES = ("rejection", "greedy")
SECTIONS = ("serve",)  # file sections that other commands read

_FIELDS = ("target", "drafter", "k", "backend", "backend_options", "prefix_cache", "draft_device",
           "verify_strategy", "draft_forced")
ALIASES = {  # file key -> field
    **{name: name for name in _FIELDS},
    "score_model": "target", "model": "target",
    "propose_model": "drafter",
    "num_propose_tokens": "k", "num_speculative_tokens": "k",
}
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
# top-level vLLM keys that pick a drafter
_DRAFTER_KEYS = ("method", "prompt_lookup_min", "prompt_lookup_max")
METHODS = ("ngram", "draft_model", "eagle", "suffix")  # vLLM method names we map


def parse_k(value) -> int | str:
    """'auto' (adaptive) or a draft length in [0, MAX_K]; every k passes through here."""
    if value == "auto":
        return "auto"
    try:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError
        k = int(value)
    except ValueError:
        k = -1
    if not 0 <= k <= MAX_K:
        raise SpecdecError(f"k must be 'auto' or an integer in [0, {MAX_K}], got {value!r}", "k")
    return k


def split_k(method: str) -> tuple[str, int | str | None]:
    """Split an engine-level `k=` option off a drafter string: "ngram:k=4:min=1" -> ("ngram:min=1", 4)."""
    if not isinstance(method, str):
        raise SpecdecError(f"drafter must be a method string, got {method!r}", "drafter")
    spec = DrafterSpec.parse(method)  # also checks the name
    if "k" not in spec.options:
        return spec.text, None
    # drop the `k=` parts in place: a hybrid's text is read part by part, in order
    rest = [part for part in spec.text.split(":") if not part.startswith("k=")]
    return ":".join(rest), parse_k(spec.options["k"])

# What generate, bench and serve use when neither a flag nor a config file names a backend:
# native where it runs the target's architecture (about twice transformers' speed on a CPU),
# else hf. The Python API keeps hf, whose logits match transformers' own generate().
CLI_BACKEND = "auto"


@dataclass(frozen=True)
class EngineConfig:
    target: str = DEFAULT_TARGET  # built-in name, .gguf file or HF model directory
    drafter: str = "ngram"  # a method string (drafters/); a `k=` option in it moves to `k`
    k: int | str = "auto"  # fixed draft length, or "auto" (adaptive, controller.py)
    backend: str = "hf"  # hf, native or auto (backends/); the CLI defaults to CLI_BACKEND
    backend_options: dict = field(default_factory=dict)  # e.g. {"precision": "int8"} for native
    prefix_cache: str = "prompt"  # prompt | decoded | off (True/False mean prompt/off)
    draft_device: str | None = None  # where a `model` drafter runs (the target stays put)
    verify_strategy: str = "rejection"  # see VERIFY_STRATEGIES
    # A grammar's forced tokens join every draft (always accepted). False scores them one
    # per forward, as plain decoding does: only for the baselines speedups are timed against.
    draft_forced: bool = True

    def __post_init__(self) -> None:
        for name in ("target", "backend"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise SpecdecError(f"{name} must be a non-empty string, got {getattr(self, name)!r}", name)
        drafter, spec_k = split_k(self.drafter)
        k = parse_k(self.k)
        if spec_k is not None and k not in ("auto", spec_k):
            raise SpecdecError(f"k is given twice: k={k} and drafter {self.drafter!r}", "k")
        if self.verify_strategy not in VERIFY_STRATEGIES:
            raise SpecdecError(f"verify_strategy must be one of {', '.join(VERIFY_STRATEGIES)}, "
                               f"got {self.verify_strategy!r}", "verify_strategy")
        if not isinstance(self.draft_forced, bool):
            raise SpecdecError(f"draft_forced must be true or false, got {self.draft_forced!r}",
                               "draft_forced")
        if self.draft_device is not None and not isinstance(self.draft_device, str):
            raise SpecdecError(f"draft_device must be a string, got {self.draft_device!r}", "draft_device")
        options = self.backend_options or {}
        if (not isinstance(options, dict)
                or not all(isinstance(key, str) and key.isidentifier() for key in options)):
            raise SpecdecError(f"backend_options must map option names to values, got {options!r}",
                               "backend_options")
        set_ = object.__setattr__  # frozen: normalize once, here
        set_(self, "drafter", drafter)
        set_(self, "k", spec_k if spec_k is not None else k)
        set_(self, "prefix_cache", prefix_cache_mode(self.prefix_cache))
        set_(self, "backend_options", dict(options))

    def override(self, **changes) -> EngineConfig:
        """A copy with `changes` applied (None values skipped); a `k=` in a new drafter
        string replaces this config's k."""
        changes = {key: value for key, value in changes.items() if value is not None}
        if "drafter" in changes and "k" not in changes:
            drafter, spec_k = split_k(changes["drafter"])
            if spec_k is not None:
                changes.update(drafter=drafter, k=spec_k)
        return dataclasses.replace(self, **changes)

    def decode_params(self, params: SamplingParams) -> SamplingParams:
        """The sampling a request gets under this verify_strategy: greedy verifies by argmax
        match, so the whole request decodes greedily."""
        return dataclasses.replace(params, temperature=0.0) if self.verify_strategy == "greedy" else params

    @classmethod
    def from_dict(cls, data: dict, source: str | Path | None = None) -> EngineConfig:
        """From our keys or their aliases (module docstring); unknown or conflicting keys are
        errors, prefixed with `source` (the file) when given."""
        try:
            return cls._from_dict(data)
        except SpecdecError as e:
            if source is None:
                raise
            raise SpecdecError(f"{source}: {e.message}", e.param) from None

    @classmethod
    def _from_dict(cls, data: dict) -> EngineConfig:
        if not isinstance(data, dict):
            raise SpecdecError(f"a config must be a mapping of keys to values, got {type(data).__name__}",
                               "config")
        unknown = [key for key in data if key not in ALIASES and key not in SPECULATIVE_KEYS
                   and key not in SECTIONS and key != "speculative_config"]
        if unknown:
            raise SpecdecError(f"unknown config key(s): {', '.join(map(str, unknown))}", str(unknown[0]))
        given: dict[str, list[tuple[str, object]]] = {}  # field -> [(key, value)]
        for key, value in data.items():
            if key in ALIASES and value is not None:
                given.setdefault(ALIASES[key], []).append((key, value))
        for key, value in _speculative(data).items():
            given.setdefault(key, []).append(value)
        for key, value in list(given.get("drafter", [])):  # a drafter's `k=` counts as a k
            if isinstance(value, str) and (spec_k := split_k(value)[1]) is not None:
                given.setdefault("k", []).append((f"{key}:k", spec_k))
        settings = {}
        for name, values in given.items():
            settings[name] = _one_value(name, values)
        return cls(**settings)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        """From a YAML file; its `serve:` section is skipped."""
        return cls.from_dict(read_config(path), source=path)


def _one_value(name: str, values: list[tuple[str, object]]):
    """The value of a field given under one or more keys; different values are an error."""
    def norm(value):
        if name == "k":
            return parse_k(value)
        if name == "drafter" and isinstance(value, str):
            return split_k(value)[0]
        return value

    first = norm(values[0][1])
    if any(norm(value) != first for _, value in values[1:]):
        shown = ", ".join(f"{key}={value!r}" for key, value in values)
        raise SpecdecError(f"conflicting values for {name}: {shown}", values[0][0])
    return first


def _speculative(data: dict) -> dict[str, tuple[str, object]]:
    """vLLM's speculative_config (top level or nested) as {field: (key, value)}."""
    nested = data.get("speculative_config") or {}
    if not isinstance(nested, dict):
        raise SpecdecError("speculative_config must be a mapping", "speculative_config")
    unknown = [key for key in nested if key not in SPECULATIVE_KEYS]
    if unknown:
        raise SpecdecError(f"unknown config key(s): {', '.join(f'speculative_config.{k}' for k in unknown)}",
                           "speculative_config")
    keys = {key: (key, data[key]) for key in _DRAFTER_KEYS if data.get(key) is not None}
    for key, value in nested.items():
        if value is None:
            continue
        name = f"speculative_config.{key}"
        if key in keys and keys[key][1] != value:
            raise SpecdecError(f"conflicting values for {key}: {key}={keys[key][1]!r}, {name}={value!r}", key)
        keys[key] = (name, value)
    out: dict[str, tuple[str, object]] = {}
    if "num_speculative_tokens" in keys:
        out["k"] = keys.pop("num_speculative_tokens")
    if keys:
        out["drafter"] = (" + ".join(name for name, _ in keys.values()), _vllm_method(keys))
    return out


def _vllm_method(keys: dict[str, tuple[str, object]]) -> str:
    """Our drafter string for vLLM's method, model and prompt_lookup_min/max."""
    values = {key: value for key, (_, value) in keys.items()}
    lookup = {key: values.pop(f"prompt_lookup_{key}") for key in ("min", "max")
              if f"prompt_lookup_{key}" in values}
    method = values.get("method") or ("ngram" if lookup else "draft_model")
    model = values.get("model")
    if method not in METHODS:
        raise SpecdecError(f"speculative method {method!r} is not supported; use one of {', '.join(METHODS)} "
                           "or propose_model", "method")
    if lookup and method != "ngram":
        raise SpecdecError(f"prompt_lookup_min/max only apply to method ngram, not {method!r}", "method")
    if method in ("ngram", "suffix"):
        if model is not None:
            raise SpecdecError(f"method {method!r} takes no draft model, got model={model!r}", "model")
        for key, value in lookup.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecdecError(f"prompt_lookup_{key} must be an integer >= 1, got {value!r}",
                                   f"prompt_lookup_{key}")
        return ":".join([method, *(f"{key}={value}" for key, value in lookup.items())])
    if not isinstance(model, str) or not model:
        raise SpecdecError(f"method {method!r} needs speculative_config.model (the draft's path)", "model")
    return f"{'model' if method == 'draft_model' else 'eagle'}:{model}"


def read_config(path: str | Path) -> dict:
    """A YAML config file as a mapping (an empty file is an empty mapping)."""
    text = Path(path).read_text(encoding="utf-8")  # a missing file raises FileNotFoundError
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecdecError(f"{path}: not valid YAML{where}", "config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecdecError(f"{path}: a config file must be a mapping of keys to values", "config")
    return data


def section(data: dict, name: str, path: str | Path | None = None) -> dict:
    """A file's `name:` mapping (e.g. serve), empty when absent."""
    value = data.get(name) or {}
    if not isinstance(value, dict):
        raise SpecdecError(f"{path or 'config'}: {name} must be a mapping", name)
    return value
