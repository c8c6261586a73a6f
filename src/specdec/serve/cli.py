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

from specdec.cli_args import add_engine_args, engine_config, nonneg_int, positive_int
from specdec.config import read_config, section
from specdec.errors import SpecdecError
from specdec.serve.ray_routing import ROUTING_MODES
from specdec.serve.tenants import read_api_keys
from specdec.tool_parsers import get_parser


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _routing(text: str) -> str:
    if text not in ROUTING_MODES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(ROUTING_MODES)}, got {text!r}")
    return text


def _log_level(text: str) -> str:
    if text not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text


def _access_log(text: str) -> str:
    if text not in ACCESS_LOGS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(ACCESS_LOGS)}, got {text!r}")
    return text


LOG_LEVELS = ("debug", "info", "warning", "error")
ACCESS_LOGS = ("json", "off")
LIST_SETTINGS = ("allow_drafter", "allowed_origins")  # repeatable flags; lists in a config file
# serve's own settings, also the keys of a config file's `serve:` mapping: name -> (type, default).
# Their flags default to None, so that a flag given on the command line wins over the file.
SETTINGS = {
    "host": (str, "127.0.0.1"),
    "port": (nonneg_int, 8000),
    "served_model_name": (str, None),
    "api_key_env": (str, None),
    "api_key_file": (str, None),
    "max_batch": (positive_int, 16),
    "max_queue": (nonneg_int, 64),
    "max_batch_tokens": (nonneg_int, None),
    "spec_off_above": (nonneg_int, 0),
    "max_prefill_tokens": (nonneg_int, 256),
    "cache_slots": (positive_int, None),
    "request_timeout": (_positive_float, 600.0),
    "max_body_bytes": (positive_int, 8 * 1024 * 1024),
    "allow_drafter": (str, []),  # repeatable; a list in a file
    "log_dir": (str, None),
    "log_max_mb": (_positive_float, 256.0),
    "log_level": (_log_level, "warning"),
    "tool_call_parser": (str, "hermes"),
    "allowed_origins": (str, []),  # repeatable; a list in a file
    "access_log": (_access_log, "json"),
    "shutdown_timeout": (_positive_float, 30.0),
    # Scale-out on Ray Serve (ray_serve.py); --replicas 1 without --ray-address is the one-process server.
    "replicas": (positive_int, 1),
    "ray_address": (str, None),
    "replica_cpus": (_positive_float, 1.0),
    "replica_gpus": (_nonneg_float, 0.0),
    "routing": (_routing, "affinity"),
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
    flag("api_key_file", "require a bearer key on /v1 from this file: one 'KEY [TENANT]' per line; keys of "
                         "different tenants share no cached state", metavar="FILE")
    flag("max_batch", "requests decoded together (default 16)")
    flag("max_queue", "requests waiting beyond the batch; then 429 (default 64)")
    flag("max_batch_tokens", "cap on tokens scored per step across requests; shrinks k under load (0: no cap; "
                             f"default {CPU_BATCH_TOKENS} on a cpu, {ACCELERATOR_BATCH_TOKENS} on an accelerator)")
    flag("spec_off_above", "turn speculation off when more requests than this are active (default 0: never)")
    flag("max_prefill_tokens", "prompt tokens prefilled per step, all new requests together, between the decode "
                               "steps of running ones (chunked prefill; default 256; 0: whole prompts on admission)")
    flag("cache_slots", "KV caches kept, in use and idle for prefix reuse; the least recently used is evicted "
                        "(default: max_batch)")
    flag("request_timeout", "seconds, queueing included (default 600)")
    flag("max_body_bytes", "default 8 MiB")
    flag("allow_drafter", "a drafter spec clients may request in the body (repeatable); bare names always allowed",
         action="append", metavar="SPEC")
    flag("log_dir", "record prompts and completions as JSONL here (off by default)")
    flag("log_max_mb", "bound on the traffic log directory (default 256)")
    flag("log_level", "default warning", choices=LOG_LEVELS)
    flag("tool_call_parser", "the model's tool-call format: hermes (<tool_call> tags, default) or json", metavar="NAME")
    flag("allowed_origins", "allow cross-origin browser requests from this origin, or * (repeatable; default none)",
         action="append", metavar="ORIGIN")
    flag("access_log", "one JSON line per request on stderr (json, default) or none (off)", choices=ACCESS_LOGS)
    flag("shutdown_timeout", "seconds running requests get to finish after SIGTERM (default 30)", metavar="S")
    flag("replicas", "replicas of the engine on Ray Serve behind one ingress (default 1: this process, no Ray); "
                     "needs pip install 'specdec[ray]'", metavar="N")
    flag("ray_address", "join this Ray cluster; `local` starts a local Ray instance (the default with --replicas > 1)",
         metavar="ADDR")
    flag("replica_cpus", "Ray CPUs per replica (default 1)", metavar="N")
    flag("replica_gpus", "Ray GPUs per replica, e.g. 1 or 0.5 (default 0)", metavar="N")
    flag("routing", "how the ingress picks a replica: affinity (a conversation stays on one, default) or random",
         choices=ROUTING_MODES)
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
        if key in LIST_SETTINGS:
            values = [value] if isinstance(value, str) else value
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise argparse.ArgumentTypeError("expected a string or a list of them")
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
        slots = settings["cache_slots"] or settings["max_batch"]
        engine = engine.override(backend_options={**engine.backend_options, "slots": slots})
    api_key = None
    if settings["api_key_env"]:
        api_key = os.environ.get(settings["api_key_env"])
        if not api_key:
            raise SpecdecError(f"--api-key-env: environment variable {settings['api_key_env']} is not set or empty",
                               "api_key_env")
    api_keys = read_api_keys(settings["api_key_file"]) if settings["api_key_file"] else {}
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
        api_keys=api_keys, allowed_origins=settings["allowed_origins"], access_log=settings["access_log"] == "json",
        shutdown_timeout=settings["shutdown_timeout"],
        max_prefill_tokens=settings["max_prefill_tokens"], cache_slots=settings["cache_slots"],
    )
    return config, settings


def run_serve(args: argparse.Namespace) -> None:
    config, settings = serve_config(args)
    if settings["replicas"] > 1 or settings["ray_address"]:
        try:
            from specdec.serve.ray_serve import run_replicas
        except ImportError as e:
            raise SpecdecError(f"--replicas needs the ray extra ({e.name} is missing): pip install 'specdec[ray]'",
                               "replicas") from None
        return run_replicas(config, settings)
    try:
        import uvicorn

        from specdec.serve.app import DrainingServer, create_app
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
    app = create_app(config)
    server = DrainingServer(  # SIGTERM: 503 to new requests, running ones finish, then exit 0
        uvicorn.Config(app, log_level=level, access_log=False, timeout_graceful_shutdown=5),
        app.state.gateway, config.shutdown_timeout,
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
