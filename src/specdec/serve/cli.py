"""`specdec serve`: the OpenAI-compatible gateway (see app.py). FastAPI and uvicorn are
imported when the server starts, so that `specdec generate` does not pay for them.

`--config FILE` holds the engine keys (config.py) and an optional `serve:` mapping whose keys
are serve's own flags (SETTINGS); flags given on the command line win over the file."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from specdec.cli import _nonneg_int, _positive_int, add_engine_args, engine_config
from specdec.config import read_config, section
from specdec.errors import SpecdecError
from specdec.tool_parsers import get_parser


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _log_level(text: str) -> str:
    if text not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text


LOG_LEVELS = ("debug", "info", "warning", "error")
# serve's own settings, also the keys of a config file's `serve:` mapping: name -> (type, default).
# Their flags default to None, so that a flag given on the command line wins over the file.
SETTINGS = {
    "host": (str, "127.0.0.1"),
    "port": (_nonneg_int, 8000),
    "served_model_name": (str, None),
    "api_key_env": (str, None),
    "max_batch": (_positive_int, 16),
    "max_queue": (_nonneg_int, 64),
    "max_batch_tokens": (_nonneg_int, None),
    "spec_off_above": (_nonneg_int, 0),
    "request_timeout": (_positive_float, 600.0),
    "max_body_bytes": (_positive_int, 8 * 1024 * 1024),
    "allow_drafter": (str, []),  # repeatable; a list in a file
    "log_dir": (str, None),
    "log_max_mb": (_positive_float, 256.0),
    "log_level": (_log_level, "warning"),
    "tool_call_parser": (str, "hermes"),
}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API with continuous batching")
    add_engine_args(p, drafter="default drafter: none | ngram[:min=N][:max=N] | suffix | model:PATH | ... (default ngram)")

    def flag(name: str, text: str, **kw) -> None:
        p.add_argument(f"--{name.replace('_', '-')}", type=SETTINGS[name][0], help=text, **kw)

    flag("host", "address to bind (default: 127.0.0.1, loopback only)")
    flag("port", "default 8000; 0 picks a free port")
    flag("served_model_name", "the model id clients send (default: the target)")
    flag("api_key_env", "require 'Authorization: Bearer <key>' on /v1, the key read from this environment variable",
         metavar="VAR")
    flag("max_batch", "requests decoded together (default 16)")
    flag("max_queue", "requests waiting beyond the batch; then 429 (default 64)")
    flag("max_batch_tokens", "cap on tokens scored per step across requests; shrinks k under load (0: no cap; "
                             f"default {CPU_BATCH_TOKENS} on a cpu, {ACCELERATOR_BATCH_TOKENS} on an accelerator)")
    flag("spec_off_above", "turn speculation off when more requests than this are active (default 0: never)")
    flag("request_timeout", "seconds, queueing included (default 600)")
    flag("max_body_bytes", "default 8 MiB")
    flag("allow_drafter", "a drafter spec clients may request in the body (repeatable); bare names always allowed",
         action="append", metavar="SPEC")
    flag("log_dir", "record prompts and completions as JSONL here (off by default)")
    flag("log_max_mb", "bound on the traffic log directory (default 256)")
    flag("log_level", "default warning", choices=LOG_LEVELS)
    flag("tool_call_parser", "the model's tool-call format: hermes (<tool_call> tags, default) or json", metavar="NAME")
    p.set_defaults(func=run_serve)


def serve_settings(args: argparse.Namespace, section: dict, source=None) -> dict:
    """serve's own settings: the flags given, else the config file's `serve:` mapping, else
    the defaults."""
    unknown = [key for key in section if key not in SETTINGS]
    if unknown:
        raise SpecdecError(f"{source}: unknown serve key(s): {', '.join(map(str, unknown))}", str(unknown[0]))
    settings = {}
    for key, (convert, default) in SETTINGS.items():
        value = getattr(args, key)
        if value is None and section.get(key) is not None:
            value = _file_value(key, convert, section[key], source)
        settings[key] = default if value is None else value
    return settings


def _file_value(key: str, convert, value, source):
    try:
        if key == "allow_drafter":
            values = [value] if isinstance(value, str) else value
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise argparse.ArgumentTypeError("expected a drafter spec or a list of them")
            return values
        if isinstance(value, dict | list):
            raise argparse.ArgumentTypeError(f"expected a single value, got {value!r}")
        return convert(str(value))
    except argparse.ArgumentTypeError as e:
        raise SpecdecError(f"{source}: serve.{key}: {e}", key) from None


# Where a batched CPU forward turned compute-bound (docs/performance-notes.md): past it every
# extra draft token costs about what it may save. Accelerators saturate far later.
CPU_BATCH_TOKENS = 40
ACCELERATOR_BATCH_TOKENS = 512


def _batch_tokens(settings: dict, options: dict) -> int:
    if settings["max_batch_tokens"] is not None:
        return settings["max_batch_tokens"]
    on_cpu = str(options.get("device") or "cpu").startswith("cpu")
    return CPU_BATCH_TOKENS if on_cpu else ACCELERATOR_BATCH_TOKENS


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SpecdecError(f"cannot listen on {host}:{port}: {e.strerror}", "port") from None
    sock.set_inheritable(True)
    return sock


def serve_config(args: argparse.Namespace):
    """The ServeConfig and serve's settings (host, port, log level, ...) from the flags and
    the --config file, checked before anything loads or listens."""
    data = read_config(args.config) if args.config else {}
    settings = serve_settings(args, section(data, "serve", args.config), args.config)
    engine = engine_config(args, data)
    if engine.backend == "native" and "slots" not in engine.backend_options:  # one cache slot per batched request
        engine = engine.override(backend_options={**engine.backend_options, "slots": settings["max_batch"]})
    api_key = None
    if settings["api_key_env"]:
        api_key = os.environ.get(settings["api_key_env"])
        if not api_key:
            raise SpecdecError(f"--api-key-env: environment variable {settings['api_key_env']} is not set or empty",
                               "api_key_env")
    try:
        from specdec.serve.app import ServeConfig
    except ImportError as e:
        raise SpecdecError(f"specdec serve needs the server extras ({e.name} is missing): pip install 'specdec[serve]'") from None
    config = ServeConfig(
        engine=engine, served_model_name=settings["served_model_name"], api_key=api_key,
        max_batch=settings["max_batch"], max_queue=settings["max_queue"],
        max_batch_tokens=_batch_tokens(settings, engine.backend_options), spec_off_above=settings["spec_off_above"],
        request_timeout=settings["request_timeout"], max_body_bytes=settings["max_body_bytes"],
        allow_drafters=settings["allow_drafter"], log_dir=settings["log_dir"],
        log_max_bytes=int(settings["log_max_mb"] * 2**20), tool_parser=get_parser(settings["tool_call_parser"]).name,
    )
    return config, settings


def run_serve(args: argparse.Namespace) -> None:
    config, settings = serve_config(args)
    try:
        import uvicorn

        from specdec.serve.app import create_app
    except ImportError as e:
        raise SpecdecError(f"specdec serve needs the server extras ({e.name} is missing): pip install 'specdec[serve]'") from None
    if config.log_dir:
        try:
            os.makedirs(config.log_dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"--log-dir {config.log_dir}: {e.strerror}", "log_dir") from None

    level = settings["log_level"]
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("specdec").setLevel(logging.INFO if level in ("debug", "info") else logging.WARNING)
    sock = _bind(settings["host"], settings["port"])
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), log_level=level, access_log=level == "debug", timeout_graceful_shutdown=5)
    )
    failures: list[str] = []

    def on_load_error(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    config.on_load_error = on_load_error
    config.on_ready = lambda: print("specdec serve: ready", file=sys.stderr, flush=True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"specdec serve: listening on http://{shown}:{port} (loading {config.engine.target})", file=sys.stderr,
          flush=True)
    server.run(sockets=[sock])
    if failures:
        raise SpecdecError(failures[0])
