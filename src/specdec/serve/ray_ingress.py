"""The ingress of `specdec serve --replicas N`: one FastAPI deployment on Ray Serve that routes
each request to a replica (ray_replica.py) through deployment handles.

- Routing (ray_routing.py): the conversation's replica, else the least-loaded one. Ray Serve's
  custom request routers (`RequestRouter`) are alpha in the pinned Ray, so the ingress routes:
  each replica index is its own deployment, and the ingress holds one handle per index.
- Every response names its replica in the `x-specdec-replica` header; `/metrics` holds the
  replicas' metrics (same names as one server's, plus a `replica` label) and the ingress's
  routing counters.
- A replica that dies mid-request answers its in-flight requests with a 503 in OpenAI's shape
  (an error event if the stream had started); the replica is skipped until a probe finds it
  back (Ray restarts it). `/health` lists the replicas: 200 while at least one serves.
"""

# No `from __future__ import annotations`: Ray Serve's class-based FastAPI routes need the
# annotations (Request) as real objects.
import asyncio
import contextlib
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import RequestCancelledError

from specdec.serve.protocol import error_body, sse
from specdec.serve.ray_routing import ReplicaRouter, conversation_key

log = logging.getLogger("specdec.server")
REPLICA_HEADER = "x-specdec-replica"
PROBE_TIMEOUT_S = 2.0
_REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
# Set again on the way out: framing by the ingress's server, x-request-id by Ray's proxy (the same id,
# which the proxy put on the request the replica saw).
_DROPPED_HEADERS = {"content-length", "transfer-encoding", "connection", "x-request-id"}

app = FastAPI(title="specdec", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


@app.exception_handler(Exception)
async def _on_error(request: Request, exc: Exception):  # as the one-process server answers a bug
    log.exception("unhandled error in the ingress")
    return error_response(500, f"internal error ({type(exc).__name__})")


class _Routing:
    """The ingress's routing metrics, in a registry of their own."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.routed = Counter("specdec:replica_requests", "Requests sent to a replica, by why it was chosen.",
                              ["replica", "route"], registry=r)
        self.failed = Counter("specdec:replica_failures", "Requests whose replica died or was unreachable.",
                              ["replica"], registry=r)
        self.in_flight = Gauge("specdec:replica_requests_in_flight", "Requests at a replica now.",
                               ["replica"], registry=r)


def _labelled(per_replica: list[tuple[int, list]]) -> list:
    """The replicas' metric families merged by name, each sample labelled with its replica."""
    merged: dict[str, Metric] = {}
    for index, families in per_replica:
        for family in families:
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type,
                                                   family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, "replica": str(index)}, s.value, s.timestamp, s.exemplar)
    return list(merged.values())


class _Families:
    """A collector that yields what the last scrape gathered from the replicas."""

    def __init__(self):
        self.families: list = []

    def collect(self):
        yield from self.families


@serve.deployment(name="specdec-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=4096)
@serve.ingress(app)
class Ingress:
    def __init__(self, replicas: list, capacity: int, routing: str, max_body_bytes: int,
                 request_timeout: float):
        self.replicas = replicas  # DeploymentHandle per replica index
        self.router = ReplicaRouter(len(replicas), capacity, routing)
        self.max_body_bytes = max_body_bytes
        self.timeout = request_timeout + 30  # the gateway answers 504 first; this only guards a hung replica
        self.stats = _Routing()
        self._families = _Families()
        self.stats.registry.register(self._families)
        self._probes: set[asyncio.Task] = set()

    # ---- replica state ------------------------------------------------------------------

    async def _call(self, index: int, method: str, *args):
        return await asyncio.wait_for(getattr(self.replicas[index], method).remote(*args), PROBE_TIMEOUT_S)

    async def _probe(self, index: int) -> None:
        with contextlib.suppress(Exception):
            if (await self._call(index, "health"))["status"] == "ok":
                self.router.mark_up(index)

    def _probe_down_replicas(self) -> None:
        for index in self.router.due_for_probe():
            task = asyncio.ensure_future(self._probe(index))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    def _gone(self, index: int, exc: BaseException) -> str:
        self.router.mark_down(index)
        self.stats.failed.labels(replica=str(index)).inc()
        return f"replica {index} failed while serving the request ({type(exc).__name__}); retry the request"

    # ---- routes ---------------------------------------------------------------------------

    @app.get("/health")
    async def health(self):
        async def one(index: int) -> dict:
            try:
                report = await self._call(index, "health")
            except Exception as e:  # dead, restarting or still loading
                self.router.mark_down(index)
                return {"replica": index, "status": "unavailable", "reason": type(e).__name__}
            if report["status"] == "ok":
                self.router.mark_up(index)
            return report

        reports = await asyncio.gather(*(one(i) for i in range(len(self.replicas))))
        serving = sum(r["status"] == "ok" for r in reports)
        if not serving:
            return error_response(503, "no replica is ready", headers={"Retry-After": "1"})
        status = "ok" if serving == len(reports) else "degraded"
        return {"status": status, "replicas": reports}

    @app.get("/metrics")
    async def metrics(self):
        async def one(index: int):
            with contextlib.suppress(Exception):
                return index, await self._call(index, "metric_families")
            return index, []

        families = await asyncio.gather(*(one(i) for i in range(len(self.replicas))))
        self._families.families = _labelled(families)
        for i, n in enumerate(self.router.in_flight):
            self.stats.in_flight.labels(replica=str(i)).set(n)
        return Response(generate_latest(self.stats.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(self, request: Request, path: str):
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        key = None
        if request.method == "POST":
            with contextlib.suppress(ValueError):
                key = conversation_key(json.loads(body))
        self._probe_down_replicas()
        index, route = self.router.choose(key)
        if index is None:
            return error_response(503, "no replica is ready", headers={"Retry-After": "1"})
        self.stats.routed.labels(replica=str(index), route=route).inc()
        headers = [(k.encode(), v.encode()) for k, v in request.headers.items()]
        self.router.acquire(index)
        released = False
        try:
            response = await self._dispatch(index, request, headers, body)
            if isinstance(response, StreamingResponse):
                released = True  # the stream releases the replica when it ends
            return response
        finally:
            if not released:
                self.router.release(index)

    async def _read_body(self, request: Request) -> bytes | Response:
        """The body, or the 413 the single server answers (guards.BodyLimit)."""
        length = request.headers.get("content-length")
        too_large = error_response(413, f"the request body exceeds {self.max_body_bytes} bytes")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _dispatch(self, index: int, request: Request, headers: list, body: bytes) -> Response:
        """Send the request to replica `index`; its answer as a response, streamed if the
        replica streams it."""
        handle = self.replicas[index].options(stream=True)
        stream = handle.http.remote(request.method, request.url.path, request.url.query.encode(),
                                    headers, body)
        try:
            _, status, raw_headers = await asyncio.wait_for(stream.__anext__(), self.timeout)
        except _REPLICA_GONE as e:
            return error_response(503, self._gone(index, e),
                                  headers={"Retry-After": "1", REPLICA_HEADER: str(index)})
        except (TimeoutError, RequestCancelledError) as e:
            stream.cancel()
            return error_response(503, self._gone(index, e),
                                  headers={"Retry-After": "1", REPLICA_HEADER: str(index)})
        out_headers = {k: v for k, v in raw_headers if k.lower() not in _DROPPED_HEADERS}
        out_headers[REPLICA_HEADER] = str(index)
        media_type = out_headers.pop("content-type", None)
        if media_type and media_type.startswith("text/event-stream"):
            return StreamingResponse(self._relay(index, stream), status_code=status, headers=out_headers,
                                     media_type=media_type)
        try:
            chunks = [chunk async for _, chunk in stream]
        except _REPLICA_GONE as e:
            return error_response(503, self._gone(index, e),
                                  headers={"Retry-After": "1", REPLICA_HEADER: str(index)})
        return Response(b"".join(chunks), status_code=status, headers=out_headers, media_type=media_type)

    async def _relay(self, index: int, stream):
        """A streamed response's chunks; if the replica dies, an error event as the single
        server sends one after the headers, then [DONE]."""
        try:
            async for _, chunk in stream:
                yield chunk
        except _REPLICA_GONE as e:
            yield sse(error_body(503, self._gone(index, e)))
            yield sse("[DONE]")
        finally:
            stream.cancel()  # a no-op once finished; frees the replica's slot if the client left
            self.router.release(index)
