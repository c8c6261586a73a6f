"""`specdec serve`: the OpenAI-compatible gateway (see server.py). Heavy imports stay lazy so
that `specdec generate` does not pay for FastAPI."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from specdec.cli import _nonneg_int, _positive_int, add_backend_args, backend_options
from specdec.errors import SpecdecError


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API with continuous batching")
    p.add_argument("--target", default="smollm2-135m", help="built-in name, .gguf file or HF model directory")
    p.add_argument("--drafter", default="ngram", help="default drafter: none | ngram[:min=N][:max=N] | model:PATH")
    p.add_argument("--k", default="auto", help="default draft length: auto (adaptive) or an integer")
    add_backend_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=_nonneg_int, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--api-key-env", metavar="VAR", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1, the key read from this environment variable")
    p.add_argument("--max-batch", type=_positive_int, default=16, help="requests decoded together")
    p.add_argument("--max-queue", type=_nonneg_int, default=64, help="requests waiting beyond the batch; then 429")
    p.add_argument("--max-batch-tokens", type=_nonneg_int, default=None,
                   help="cap on tokens scored per step across requests; shrinks k under load (0: no cap; "
                        f"default {CPU_BATCH_TOKENS} on a cpu, {ACCELERATOR_BATCH_TOKENS} on an accelerator)")
    p.add_argument("--spec-off-above", type=_nonneg_int, default=0,
                   help="turn speculation off when more requests than this are active (0: never)")
    p.add_argument("--request-timeout", type=_positive_float, default=600.0, help="seconds, queueing included")
    p.add_argument("--max-body-bytes", type=_positive_int, default=8 * 1024 * 1024)
    p.add_argument("--allow-drafter", action="append", default=[], metavar="SPEC",
                   help="a drafter spec clients may request in the body (repeatable); bare names always allowed")
    p.add_argument("--log-dir", default=None, help="record prompts and completions as JSONL here (off by default)")
    p.add_argument("--log-max-mb", type=_positive_float, default=256.0, help="bound on the traffic log directory")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_serve)


# Measured on the 2-core dev box (SmolLM2-135M, int4): a forward of 8 sequences x 5 tokens
# costs 4.7x one 5-token chain, so past ~40 tokens a step is compute-bound and every extra
# draft token costs about what it may save. Accelerators saturate far later.
CPU_BATCH_TOKENS = 40
ACCELERATOR_BATCH_TOKENS = 512


def _batch_tokens(args: argparse.Namespace, options: dict) -> int:
    if args.max_batch_tokens is not None:
        return args.max_batch_tokens
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


def _backend_options(args: argparse.Namespace) -> dict:
    options = backend_options(args)
    if args.backend == "native":
        options.setdefault("slots", args.max_batch)  # one cache slot per request in the batch
    return options


def run_serve(args: argparse.Namespace) -> None:
    from specdec.controller import make_controller
    from specdec.drafters import DrafterSpec

    make_controller(args.k)
    DrafterSpec.parse(args.drafter)
    options = _backend_options(args)  # fails before listening; the rest is checked while loading
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise SpecdecError(f"--api-key-env: environment variable {args.api_key_env} is not set or empty", "api_key_env")
    try:
        import uvicorn

        from specdec.serve.app import ServeConfig, create_app
    except ImportError as e:
        raise SpecdecError(f"specdec serve needs the server extras ({e.name} is missing): pip install 'specdec[serve]'") from None
    if args.log_dir:
        try:
            os.makedirs(args.log_dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"--log-dir {args.log_dir}: {e.strerror}", "log_dir") from None

    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("specdec").setLevel(logging.INFO if args.log_level in ("debug", "info") else logging.WARNING)
    config = ServeConfig(
        target=args.target, drafter=args.drafter, k=args.k, backend=args.backend, backend_options=options,
        draft_device=args.draft_device, prefix_cache=args.prefix_cache,
        served_model_name=args.served_model_name, api_key=api_key, max_batch=args.max_batch,
        max_queue=args.max_queue, max_batch_tokens=_batch_tokens(args, options), spec_off_above=args.spec_off_above,
        request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
        allow_drafters=args.allow_drafter, log_dir=args.log_dir, log_max_bytes=int(args.log_max_mb * 2**20),
    )
    sock = _bind(args.host, args.port)
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), log_level=args.log_level, access_log=args.log_level == "debug",
                       timeout_graceful_shutdown=5)
    )
    failures: list[str] = []

    def on_load_error(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    config.on_load_error = on_load_error
    config.on_ready = lambda: print("specdec serve: ready", file=sys.stderr, flush=True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"specdec serve: listening on http://{shown}:{port} (loading {args.target})", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if failures:
        raise SpecdecError(failures[0])
