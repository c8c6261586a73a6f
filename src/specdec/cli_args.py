"""Command-line pieces every `specdec` subcommand shares: argument types, the model and
engine flags, and the EngineConfig they build. The subcommands' parsers import this module,
never `specdec.cli` (which imports them)."""

from __future__ import annotations

import argparse

from specdec.backends import available as available_backends
from specdec.backends.auto import resolve_backend
from specdec.backends.prefix_cache import PREFIX_CACHE_MODES
from specdec.config import CLI_BACKEND, VERIFY_STRATEGIES, EngineConfig, read_config
from specdec.errors import SpecdecError
from specdec.models import DEFAULT_TARGET


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="built-in name, .gguf file or HF model directory")


def add_engine_args(p: argparse.ArgumentParser, drafter: str | None = None) -> None:
    """--config and the EngineConfig flags. A flag left out keeps the file's value, else
    EngineConfig's default; `drafter` is the --drafter help (None: no --drafter flag)."""
    p.add_argument("--config", metavar="FILE",
                   help="YAML engine settings (see README, Configuration); flags override it")
    p.add_argument("--target",
                   help=f"built-in name, .gguf file or HF model directory (default {DEFAULT_TARGET})")
    if drafter is not None:
        p.add_argument("--drafter", help=drafter)
    p.add_argument("--k", help="draft length: auto (adaptive, the default) or an integer")
    p.add_argument("--verify-strategy", choices=VERIFY_STRATEGIES,
                   help="rejection: lossless speculative sampling, exact greedy matching at temperature 0 "
                        "(default); greedy: verify by argmax match, so every request decodes greedily")
    add_backend_args(p)


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", help="model backend: auto (the default: native for llama, mistral, qwen2/3, "
                                     "gemma3 and phi3 targets, else hf, with a notice), native (lean "
                                     "PyTorch) or hf (transformers)")
    p.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option, repeatable (native: precision=gguf|fp32|bf16|int8|int4, gguf: a "
                        "GGUF's own types, the default for GGUF files on a cpu; device=cuda, max_length=N "
                        "(default: the model's window, its memory committed as tokens are held), "
                        "kv_dtype=bf16|fp32|fp16 (default: bf16 on a cpu, fp32 with precision=fp32), "
                        "compile=1: torch.compile the decode step, for faster single streams; no token "
                        "trees, and a batch runs one sequence at a time)")
    p.add_argument("--draft-device", metavar="DEVICE",
                   help="where a model drafter runs, e.g. cpu while the target is on cuda (default: cpu for "
                        "a GGUF draft, else the draft model's)")
    p.add_argument("--prefix-cache", choices=PREFIX_CACHE_MODES,
                   help="reuse the cached start of a prompt: prompt tokens only, bit-exact against a cold "
                        "start (default); decoded: the previous answers too, so a conversation's next turn "
                        "skips re-reading them (a warm conversation may then differ from a cold one in the "
                        "last bits)")


ENGINE_FLAGS = ("target", "drafter", "k", "backend", "prefix_cache", "draft_device", "verify_strategy")


def engine_config(args: argparse.Namespace, data: dict | None = None) -> EngineConfig:
    """The --config file's settings (`data`: the file already read), then the flags given on
    the command line, which win. Checked before any model is loaded."""
    source = getattr(args, "config", None)
    if data is None:
        data = read_config(source) if source else {}
    config = EngineConfig.from_dict(data, source=source)
    options = dict(config.backend_options)
    for item in getattr(args, "backend_option", None) or []:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise SpecdecError(f"--backend-option expects KEY=VALUE, got {item!r}", "backend_option")
        options[key] = value
    config = config.override(**{name: getattr(args, name, None) for name in ENGINE_FLAGS},
                             backend_options=options)
    if getattr(args, "backend", None) is None and data.get("backend") is None:
        config = config.override(backend=CLI_BACKEND)
    if config.backend not in available_backends():
        raise SpecdecError(f"unknown backend {config.backend!r}; "
                           f"choose one of: {', '.join(available_backends())}", "backend")
    # auto: native or hf, by name
    return config.override(backend=resolve_backend(config.backend, config.target))
