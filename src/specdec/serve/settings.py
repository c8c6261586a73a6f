"""`ServeConfig`: every setting of `specdec serve`, in one place.

Each setting is a dataclass field whose metadata carries its flag's help, type and form; the
command-line flags, the keys of a config file's `serve:` mapping and the documentation's
reference are all generated from these fields, so they cannot drift apart. Names that
earlier releases used still work as deprecated aliases (ALIASES), with a warning.

No FastAPI here: the CLI builds and checks a ServeConfig before the server's imports.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import MISSING, dataclass, field, fields

from specdec.cli_args import nonneg_int, positive_int
from specdec.config import EngineConfig
from specdec.errors import SpecdecError
from specdec.serve.ray_routing import ROUTING_MODES
from specdec.serve.tenants import key_tenant
from specdec.tools import DEFAULT_PARSER


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonneg_float(text: str) -> float:
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def one_of(*choices: str):
    def convert(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    return convert


LOG_LEVELS = ("debug", "info", "warning", "error")
ACCESS_LOGS = ("json", "off")
# Where a batched CPU forward turned compute-bound (docs/performance-notes.md): past it every
# extra draft token costs about what it may save. Accelerators saturate far later.
CPU_BATCH_TOKENS = 40
ACCELERATOR_BATCH_TOKENS = 512


def setting(default, help: str, type=str, repeat: bool = False, metavar: str | None = None):
    """A serve setting: a flag --name-with-dashes, a `serve:` key name_with_underscores.
    `repeat`: the flag may be given several times and the file takes a string or a list."""
    meta = {"help": help, "type": type, "repeat": repeat, "metavar": metavar}
    if isinstance(default, list):
        return field(default_factory=list, metadata={"setting": meta})
    return field(default=default, metadata={"setting": meta})


@dataclass
class ServeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)  # target, default drafter and k, backend, ...
    host: str = setting("127.0.0.1", "address to bind (default: loopback only)")
    port: int = setting(8000, "0 picks a free port", nonneg_int)
    served_model_name: str | None = setting(None, "the model id clients send (default: the target)")
    api_key_env: str | None = setting(
        None, "require 'Authorization: Bearer <key>' on /v1, the key read from this environment variable",
        metavar="VAR")
    api_key_file: str | None = setting(
        None, "require a bearer key on /v1 from this file: one 'KEY [TENANT]' per line; keys of different "
              "tenants share no cached state", metavar="FILE")
    max_batch: int = setting(16, "requests decoded together", positive_int)
    max_queue: int = setting(64, "requests waiting beyond the batch; then 429", nonneg_int)
    max_batch_tokens: int | None = setting(
        None, "cap on tokens scored per step across requests; shrinks k under load (0: no cap; default "
              f"{CPU_BATCH_TOKENS} on a cpu, {ACCELERATOR_BATCH_TOKENS} on an accelerator)", nonneg_int)
    spec_off_above: int = setting(
        0, "turn speculation off when more requests than this are active (0: never)", nonneg_int)
    max_prefill_tokens: int = setting(
        256, "prompt tokens prefilled per step, all new requests together, between the decode steps of "
             "running ones (chunked prefill; 0: whole prompts on admission)", nonneg_int)
    cache_slots: int | None = setting(
        None, "KV caches kept, in use and idle for prefix reuse; the least recently used is evicted "
              "(default: max_batch)", positive_int)
    request_timeout: float = setting(600.0, "seconds, queueing included", positive_float)
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest request body", positive_int)
    allow_drafters: list[str] = setting(
        [], "a drafter spec clients may request in the body (repeatable); bare names always allowed",
        repeat=True, metavar="SPEC")
    log_dir: str | None = setting(None, "record prompts and completions as JSONL here (off by default)")
    log_max_mb: float = setting(256.0, "bound on the traffic log directory, in MiB", positive_float)
    log_level: str = setting("warning", "server log level", one_of(*LOG_LEVELS))
    tool_call_parser: str = setting(DEFAULT_PARSER, "the model's tool-call format: hermes (<tool_call> tags) "
                                                    "or json", metavar="NAME")
    allowed_origins: list[str] = setting(
        [], "allow cross-origin browser requests from this origin, or * (repeatable; default none)",
        repeat=True, metavar="ORIGIN")
    access_log: str = setting("json", "one JSON line per request on stderr (json) or none (off)",
                              one_of(*ACCESS_LOGS))
    shutdown_timeout: float = setting(30.0, "seconds running requests get to finish after SIGTERM",
                                      positive_float, metavar="S")
    # Scale-out on Ray Serve (ray_serve.py); replicas 1 without ray_address is the one-process server.
    replicas: int = setting(1, "replicas of the engine on Ray Serve behind one ingress (1: this process, no "
                               "Ray); needs pip install 'specdec[ray]'", positive_int, metavar="N")
    ray_address: str | None = setting(None, "join this Ray cluster; `local` starts a local Ray instance (the "
                                            "default with replicas > 1)", metavar="ADDR")
    replica_cpus: float = setting(1.0, "Ray CPUs per replica", positive_float, metavar="N")
    replica_gpus: float = setting(0.0, "Ray GPUs per replica, e.g. 1 or 0.5", nonneg_float, metavar="N")
    routing: str = setting("affinity", "how the ingress picks a replica: affinity (a conversation stays on "
                                       "one) or random", one_of(*ROUTING_MODES))
    # Resolved at start-up, not settings: the keys themselves, and the server's callbacks.
    api_key: str | None = None  # read from the environment variable api_key_env names
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant, read from api_key_file
    on_load_error: object = None  # callable(message) run when loading fails
    on_ready: object = None  # callable() run once the model serves

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.target

    @property
    def log_max_bytes(self) -> int:
        return int(self.log_max_mb * 2**20)

    def batch_tokens(self) -> int:
        """max_batch_tokens, or its default for the device the target runs on."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        on_cpu = str(self.engine.backend_options.get("device") or "cpu").startswith("cpu")
        return CPU_BATCH_TOKENS if on_cpu else ACCELERATOR_BATCH_TOKENS

    def keys(self) -> dict[str, str]:
        """Every accepted key -> its tenant; empty when the server needs no key."""
        keys = dict(self.api_keys)
        if self.api_key:
            keys.setdefault(self.api_key, key_tenant(self.api_key))
        return keys


SETTINGS = {f.name: f for f in fields(ServeConfig) if "setting" in f.metadata}
# deprecated name -> the name that replaced it (flags and `serve:` keys alike)
ALIASES = {"allow_drafter": "allow_drafters", "tool_parser": "tool_call_parser"}


def default_of(name: str):
    f = SETTINGS[name]
    return f.default_factory() if f.default is MISSING else f.default


class _DeprecatedFlag(argparse.Action):
    """A flag's old name: it warns, then sets (or appends to) the new name's value."""

    def __init__(self, option_strings, dest, repeat: bool = False, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.repeat = repeat

    def __call__(self, parser, namespace, values, option_string=None):
        new = f"--{self.dest.replace('_', '-')}"
        warnings.warn(f"{option_string} is deprecated; use {new}", DeprecationWarning, stacklevel=2)
        setattr(namespace, self.dest,
                [*(getattr(namespace, self.dest) or []), values] if self.repeat else values)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """One flag per setting (and its deprecated aliases). Flags default to None, so that a
    flag given on the command line wins over the config file."""
    for name, f in SETTINGS.items():
        meta, default = f.metadata["setting"], default_of(name)
        shown = "" if default in (None, []) or "default" in meta["help"] else f" (default {default})"
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=meta["type"], help=meta["help"] + shown,
                       metavar=meta["metavar"], action="append" if meta["repeat"] else "store")
        for old in [old for old, new in ALIASES.items() if new == name]:
            p.add_argument(f"--{old.replace('_', '-')}", dest=name, type=meta["type"], help=argparse.SUPPRESS,
                           metavar=meta["metavar"], action=_DeprecatedFlag, repeat=meta["repeat"])


def settings_from(args: argparse.Namespace, section: dict, source=None) -> dict:
    """serve's settings: the flags given, else the config file's `serve:` mapping, else the
    defaults. Deprecated keys warn and map to their replacements."""
    section = dict(section)
    for old in [key for key in section if key in ALIASES]:
        warnings.warn(f"{source}: serve.{old} is deprecated; use serve.{ALIASES[old]}", DeprecationWarning,
                      stacklevel=2)
        section.setdefault(ALIASES[old], section.pop(old))
    unknown = [key for key in section if key not in SETTINGS]
    if unknown:
        raise SpecdecError(f"{source}: unknown serve key(s): {', '.join(map(str, unknown))}", str(unknown[0]))
    out = {}
    for name, f in SETTINGS.items():
        value = getattr(args, name, None)
        if value is None and section.get(name) is not None:
            value = _file_value(name, f.metadata["setting"], section[name], source)
        out[name] = default_of(name) if value is None else value
    return out


def _file_value(key: str, meta: dict, value, source):
    try:
        if meta["repeat"]:
            values = [value] if isinstance(value, str) else value
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise argparse.ArgumentTypeError("expected a string or a list of them")
            return values
        if isinstance(value, dict | list):
            raise argparse.ArgumentTypeError(f"expected a single value, got {value!r}")
        return meta["type"](str(value))
    except argparse.ArgumentTypeError as e:
        raise SpecdecError(f"{source}: serve.{key}: {e}", key) from None


def reference_rows() -> list[tuple[str, str, str, str]]:
    """(yaml key, flag, default, help) per setting: the docs' configuration reference."""
    rows = []
    for name, f in SETTINGS.items():
        default = default_of(name)
        rows.append((name, f"--{name.replace('_', '-')}", "" if default in (None, []) else str(default),
                     f.metadata["setting"]["help"]))
    return rows
