"""`specdec serve`: the OpenAI-compatible gateway (see app.py). FastAPI and uvicorn are
imported when the server starts, so that `specdec generate` does not pay for them.

`--config FILE` holds the engine keys (config.py) and an optional `serve:` mapping whose keys
are serve's own settings (ServeConfig in settings.py, which also makes the flags); flags given
on the command line win over the file."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from specdec.cli_args import add_engine_args, engine_config
from specdec.config import read_config, section
from specdec.errors import SpecdecError
from specdec.serve.settings import ServeConfig, add_serve_flags, settings_from
from specdec.serve.tenants import read_api_keys
from specdec.tool_parsers import get_parser


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API with continuous batching")
    add_engine_args(p, drafter="default drafter: none | ngram[:min=N][:max=N] | suffix | model:PATH | ... "
                               "(default ngram)")
    add_serve_flags(p)
    p.set_defaults(func=run_serve)


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


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig from the flags and the --config file, checked before anything loads or
    listens."""
    data = read_config(args.config) if args.config else {}
    settings = settings_from(args, section(data, "serve", args.config), args.config)
    engine = engine_config(args, data)
    # one cache slot per batched request
    if engine.backend == "native" and "slots" not in engine.backend_options:
        slots = settings["cache_slots"] or settings["max_batch"]
        engine = engine.override(backend_options={**engine.backend_options, "slots": slots})
    config = ServeConfig(engine=engine, **settings)
    config.tool_call_parser = get_parser(config.tool_call_parser).name
    config.max_batch_tokens = config.batch_tokens()
    if config.api_key_env:
        config.api_key = os.environ.get(config.api_key_env)
        if not config.api_key:
            raise SpecdecError(f"--api-key-env: environment variable {config.api_key_env} "
                               "is not set or empty", "api_key_env")
    config.api_keys = read_api_keys(config.api_key_file) if config.api_key_file else {}
    return config


def run_serve(args: argparse.Namespace) -> None:
    config = serve_config(args)
    if config.replicas > 1 or config.ray_address:
        try:
            from specdec.serve.ray_serve import run_replicas
        except ImportError as e:
            raise SpecdecError(f"--replicas needs the ray extra ({e.name} is missing): "
                               "pip install 'specdec[ray]'", "replicas") from None
        return run_replicas(config)
    try:
        import uvicorn

        from specdec.serve.app import DrainingServer, create_app
    except ImportError as e:
        raise SpecdecError(f"specdec serve needs the server extras ({e.name} is missing): "
                           "pip install 'specdec[serve]'") from None
    if config.log_dir:
        try:
            os.makedirs(config.log_dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"--log-dir {config.log_dir}: {e.strerror}", "log_dir") from None

    level = config.log_level
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("specdec").setLevel(logging.INFO if level in ("debug", "info") else logging.WARNING)
    sock = _bind(config.host, config.port)
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
    config.on_ready = lambda: print(ready_line(app.state.gateway.scheduler), file=sys.stderr, flush=True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"specdec serve: listening on http://{shown}:{port} (loading {config.engine.target})",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if failures:
        raise SpecdecError(failures[0])


def ready_line(scheduler) -> str:
    """What the server says when it is ready: the KV memory it may use, and a warning where
    every slot full would not fit in the memory available now."""
    memory = scheduler.kv_memory()
    if memory is None:
        return "specdec serve: ready"
    line = f"specdec serve: ready; {memory.describe()}"
    available = available_memory()
    if available and memory.limit_bytes > available:
        line += (f" (more than the {available / 1024**3:.1f} GiB available now: fewer --cache-slots, a "
                 "shorter max_length or kv_dtype=bf16 bound it)")
    return line


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
