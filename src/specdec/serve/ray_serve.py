"""`specdec serve --replicas N [--ray-address ADDR]`: N specdec replicas on Ray Serve behind one
OpenAI-compatible ingress (ray_ingress.py, ray_replica.py). Needs the ray extra:
`pip install 'specdec[ray]'`.

Without --ray-address (or with `--ray-address local`, which puts even one replica on Ray) a
local Ray instance is started with enough logical CPUs for the replicas; with an address, the
app joins that cluster (`ray://...` or a GCS address), and is deleted from it on exit,
leaving the cluster running. Each replica loads the target itself, so the model path must
exist on every node (or be a built-in name).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

import ray
from ray import serve

from specdec.errors import SpecdecError
from specdec.serve.app import ServeConfig
from specdec.serve.ray_ingress import Ingress
from specdec.serve.ray_replica import replica_deployment

APP_NAME = "specdec"
# Ray gives its HTTP proxy 60 s to start, then serve.start raises while the proxy keeps
# starting; with the cores busy it can need longer, so specdec waits this long for it.
PROXY_START_S = 600


def build_application(config: ServeConfig, replicas: int, routing: str = "affinity", cpus: float = 1.0,
                      gpus: float = 0.0):
    """The Ray Serve application: the ingress bound to one handle per replica deployment."""
    handles = [replica_deployment(config, i, cpus, gpus) for i in range(replicas)]
    return Ingress.bind(handles, config.max_batch, routing, config.max_body_bytes, config.request_timeout)


def _free_port(host: str) -> int:
    """Ray Serve's proxy wants a fixed port: ask the OS for a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_ray(address: str | None, replicas: int, cpus: float) -> None:
    """Join the cluster at `address`, or start a local one that fits the replicas."""
    quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    try:
        if address:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        else:
            # address="local": a new instance, never a cluster another process left running here.
            # Ray runs workers at niceness 15; replicas are the service, not background work.
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(replicas * cpus)),
                     _system_config={"worker_niceness": 0}, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise SpecdecError(f"cannot start {where}: {str(e).splitlines()[0]}", "ray_address") from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _start_serve(host: str, port: int, wait_s: float = PROXY_START_S) -> None:
    """serve.start, waiting past Ray's own 60 s for the HTTP proxy until it answers at all."""
    options = {"host": host, "port": port}
    try:
        serve.start(http_options=options)
        return
    except TimeoutError:
        serve.start(http_options=options)  # connects to the controller the first call started
    local = "127.0.0.1" if host in ("", "0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if _proxy_answers(f"http://{local}:{port}/-/healthz"):
            return
        time.sleep(1)
    raise SpecdecError(f"Ray Serve's HTTP proxy did not start within {wait_s:.0f} s", "replicas")


def _proxy_answers(url: str) -> bool:
    """Whether an HTTP server answers `url` with any status: until an app is deployed, Ray's
    proxy answers /-/healthz with 503 (its route table is empty), so 200 would never come."""
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def run_replicas(config: ServeConfig) -> None:
    """Serve until SIGINT or SIGTERM, then take the app (and a local Ray) down."""
    host, port = config.host, config.port or _free_port(config.host)
    replicas, address = config.replicas, config.ray_address
    if address == "local":  # Ray's own word for a new local instance: even one replica runs on Ray
        address = None
    start_ray(address, replicas, config.replica_cpus)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM, like Ctrl-C, ends serve.run's wait too
    try:
        _start_serve(host, port)
        shown = f"[{host}]" if ":" in host else host
        print(f"specdec serve: listening on http://{shown}:{port} ({replicas} replica(s) on Ray, "
              f"loading {config.engine.target})", file=sys.stderr, flush=True)
        app = build_application(config, replicas, config.routing, config.replica_cpus, config.replica_gpus)
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica's constructor failed (say, the model did not load)
            raise SpecdecError(f"the replicas did not start: {str(e).splitlines()[0]}") from None
        print("specdec serve: ready", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if address:
            with contextlib.suppress(Exception):
                serve.delete(APP_NAME)
        else:
            serve.shutdown()
            ray.shutdown()
