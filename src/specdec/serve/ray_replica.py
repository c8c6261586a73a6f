"""One specdec replica as a Ray Serve deployment: the single-process server's own app
(`create_app`: the Gateway, its scheduler, routes, guards and metrics) driven over ASGI by the
ingress (ray_ingress.py), so the API, errors and metrics are the same code.

Each replica index is its own deployment of one replica (`specdec-replica-<i>`), so the
ingress can send a conversation to the replica that holds its state; Ray restarts a replica
whose process dies. The model loads in the constructor: Ray counts a replica as running only
once it can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os

import ray
from ray import serve

from specdec.errors import SpecdecError
from specdec.serve.app import ServeConfig, create_app


def _scope(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]]) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
        "method": method, "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
        "headers": headers, "client": ("ray-ingress", 0), "server": ("specdec-replica", 0),
    }


class ReplicaServer:
    """The replica's state: the app of serve/app.py, started through its own lifespan, and
    the replica's identity."""

    async def __init__(self, config: ServeConfig, index: int):
        # one writer each
        log_dir = os.path.join(config.log_dir, f"replica-{index}") if config.log_dir else None
        config = dataclasses.replace(config, log_dir=log_dir, on_load_error=None, on_ready=None)
        self.index = index
        self.app = create_app(config)
        self.gateway = self.app.state.gateway
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts loading the model in a thread, as one server does
        while not self.gateway.ready:
            if self.gateway.load_error:  # Ray reports the deployment as failed
                raise SpecdecError(f"model failed to load: {self.gateway.load_error}")
            await asyncio.sleep(0.05)
        self.pid = os.getpid()
        self.node_id = ray.get_runtime_context().get_node_id()

    async def http(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        """Run one HTTP request through the app. Yields ("start", status, headers), then
        ("body", bytes) chunks as the app sends them (a stream stays a stream). If the ingress
        goes away (its client disconnected), the app sees http.disconnect and frees the slot."""
        sent: asyncio.Queue = asyncio.Queue()
        finished = asyncio.Event()
        body_given = False

        async def receive():
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await finished.wait()
            return {"type": "http.disconnect"}

        app = asyncio.ensure_future(self.app(_scope(method, path, query, headers), receive, sent.put))
        try:
            while True:
                message = asyncio.ensure_future(sent.get())
                await asyncio.wait({message, app}, return_when=asyncio.FIRST_COMPLETED)
                if not message.done():  # the app returned without sending more
                    message.cancel()
                    app.result()  # re-raise its exception, if any
                    return
                msg = message.result()
                if msg["type"] == "http.response.start":
                    yield ("start", msg["status"],
                           [(k.decode(), v.decode()) for k, v in msg.get("headers", [])])
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield ("body", msg["body"])
                    if not msg.get("more_body", False):
                        return
        finally:
            finished.set()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(app, 5)

    def health(self) -> dict:
        scheduler = self.gateway.scheduler
        return {
            "replica": self.index, "status": "ok" if self.gateway.ready else "unavailable", "pid": self.pid,
            "node_id": self.node_id, "running": scheduler.num_active if scheduler else 0,
            "waiting": scheduler.queue_depth if scheduler else 0,
        }

    def metric_families(self) -> list:
        """The replica's Prometheus metric families (picklable), for the ingress's /metrics."""
        return list(self.gateway.metrics.registry.collect())

    async def __del__(self):
        """Ray Serve calls this when it stops the replica: the app's shutdown (the scheduler)."""
        with contextlib.suppress(Exception):
            await self._lifespan.__aexit__(None, None, None)


def replica_deployment(config: ServeConfig, index: int, cpus: float, gpus: float):
    """The bound deployment of replica `index`: one Ray actor with these resources. Its
    concurrency limit sits above the gateway's batch and queue, so the gateway's own 429
    answers an overload, as on a single server."""
    options = {"num_cpus": cpus}
    if gpus:
        options["num_gpus"] = gpus
    deployment = serve.deployment(ReplicaServer).options(
        name=f"specdec-replica-{index}", num_replicas=1, ray_actor_options=options,
        max_ongoing_requests=config.max_batch + config.max_queue + 8,  # + health and metrics calls
        health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=5,
        max_constructor_retry_count=2,  # a model that does not load fails `serve.run` soon
    )
    return deployment.bind(config, index)
