"""`specdec serve --replicas 2` on a local Ray cluster, driven over HTTP by the official client.

Routing is checked on its own first (no Ray). The Ray tests (marked `ray` and `slow`: the fast
command skips them, `make test` runs them) start one real `specdec serve --replicas 2` process
(its own `ray.init(num_cpus=2)`) and one single-process server on the same tiny random model:
- greedy replies, streamed or not, are identical to the single server's, with drafts accepted;
- errors have the same bodies;
- the replicas run at the server's priority, not Ray's default niceness of 15;
- each conversation's turns land on one replica (the `x-specdec-replica` header and the
  ingress's routing counters), and the conversations spread over both replicas;
- a replica killed (SIGKILL) while requests run answers them with a clean error (a 503, or an
  error event in a stream), Ray restarts it, and its conversations go back to it.
"""

from __future__ import annotations

import http.server
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import save_loaded, tiny_llama
from specdec.errors import SpecdecError
from specdec.serve.ray_routing import ReplicaRouter, conversation_key, jump_hash

# ---- routing, no Ray ----------------------------------------------------------------------------


def test_conversation_key_follows_the_conversation_not_its_latest_turn():
    turn1 = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "and now?"}]}
    other = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]}
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                          {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert conversation_key(turn1) == conversation_key(turn2) == conversation_key(parts)
    assert conversation_key(turn1) != conversation_key(other)
    assert conversation_key({**turn2, "user": "agent-1"}) == "user:agent-1"
    assert conversation_key({**turn2, "user": "agent-1", "prompt_cache_key": "k"}) == "key:k"
    assert conversation_key({"prompt": "x" * 600}) == conversation_key({"prompt": "x" * 600 + " more"})
    assert conversation_key({"prompt": [1, 2, 3]}) is not None
    for body in ([], "text", {}, {"messages": []}, {"messages": "x"}, {"user": ""}):
        assert conversation_key(body) is None


def test_jump_hash_is_balanced_and_moves_few_keys():
    keys = [f"user:{i}" for i in range(4000)]
    two = [jump_hash(k, 2) for k in keys]
    three = [jump_hash(k, 3) for k in keys]
    assert 0.45 < sum(two) / len(keys) < 0.55
    moved = sum(a != b for a, b in zip(two, three, strict=True))
    # moved keys go to the new replica only
    assert all(b == 2 for a, b in zip(two, three, strict=True) if a != b)
    assert 0.28 < moved / len(keys) < 0.39  # about 1/3
    with pytest.raises(ValueError):
        jump_hash("k", 0)


def test_router_prefers_the_owner_until_it_is_saturated_or_down():
    router = ReplicaRouter(2, capacity=2)
    key = next(f"user:{i}" for i in range(100) if jump_hash(f"user:{i}", 2) == 1)
    assert router.choose(key) == (1, "affinity")
    router.acquire(1)
    router.acquire(1)  # saturated: its batch is full, replica 0 is idle
    assert router.choose(key) == (0, "fallback")
    router.acquire(0)
    router.acquire(0)
    router.acquire(0)  # everyone is busier: back to the owner
    assert router.choose(key) == (1, "affinity")
    router.release(1)
    router.mark_down(1)
    assert router.choose(key) == (0, "fallback")
    assert router.choose(None) == (0, "least_loaded")
    router.mark_down(0)
    assert router.choose(key) == (None, "down")
    router.mark_up(1)
    assert router.choose(key) == (1, "affinity")
    assert {ReplicaRouter(2, 2, "random").choose(key)[1] for _ in range(5)} == {"random"}
    with pytest.raises(ValueError):
        ReplicaRouter(2, 2, "nearest")


def test_replicas_without_ray_is_a_one_line_error(monkeypatch, tmp_path):
    from specdec.cli import build_parser
    from specdec.serve.cli import run_serve

    model_dir = save_loaded(tiny_llama(0), tmp_path / "m")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    monkeypatch.delitem(sys.modules, "specdec.serve.ray_serve", raising=False)
    args = build_parser().parse_args(["serve", "--target", model_dir, "--replicas", "2"])
    with pytest.raises(SpecdecError, match=r"pip install 'specdec\[ray\]'"):
        run_serve(args)


class _ProxyWithoutApp(http.server.BaseHTTPRequestHandler):
    """What Ray Serve's proxy answers before an app is deployed (read from Ray 2.60's
    proxy_router.ready_for_traffic): 503, its route table not yet populated."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(503)
        self.end_headers()
        self.wfile.write(b"Route table is not populated yet.")

    def log_message(self, *args):
        pass


def test_serve_start_waits_past_rays_own_proxy_timeout(monkeypatch):
    """Ray raises TimeoutError when its HTTP proxy takes over 60 s to start (a busy machine),
    while the proxy keeps starting: specdec connects again and waits until the proxy answers,
    which before the app is deployed is a 503 (waiting for a 200 there hung a loaded run for
    the whole wait); with no proxy at all it ends in a one-line error."""
    pytest.importorskip("ray.serve")
    from specdec.serve import ray_serve

    calls = []

    def start(http_options):
        calls.append(http_options)
        if len(calls) % 2 == 1:
            raise TimeoutError("HTTP proxies not available after 60s.")

    monkeypatch.setattr(ray_serve.serve, "start", start)
    proxy = http.server.HTTPServer(("127.0.0.1", 0), _ProxyWithoutApp)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        ray_serve._start_serve("127.0.0.1", proxy.server_address[1], wait_s=60)
    finally:
        proxy.shutdown()
    assert len(calls) == 2  # the second call joins the controller the first one started
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there
    with pytest.raises(SpecdecError, match="did not start within"):
        ray_serve._start_serve("127.0.0.1", port, wait_s=1)


# ---- two replicas on a local Ray cluster --------------------------------------------------------

# Ray Serve gives its HTTP proxy 5 s to answer the first ready check (and 10 s for a health
# check) before it kills the actor, and `serve.start` then fails. With both cores busy, the
# proxy can take longer to start, so the tests give it two minutes. These are hang guards only.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "RAY_USAGE_STATS_ENABLED": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
       "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "120"}
SERVE_ARGS = ("--drafter", "ngram:min=1", "--max-batch", "4", "--served-model-name", "tiny")


class Server:
    """`specdec serve` as a process; ready once it prints `ready` and /health answers 200."""

    def __init__(self, *args: str):
        cmd = [sys.executable, "-m", "specdec.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=ENV)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def wait_ready(self, wait_s: float = 900) -> Server:  # Ray starts in well under a minute on idle cores
        if not self._ready.wait(wait_s) or not any("specdec serve: ready" in line for line in self.lines):
            self.close()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-30:]))
        port = re.search(r"listening on http://127\.0\.0\.1:(\d+)", "".join(self.lines)).group(1)
        self.url = f"http://127.0.0.1:{port}"
        self.wait_healthy(60)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)
        return self

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "specdec serve: ready" in line:
                self._ready.set()
        self._ready.set()  # exited

    def health(self) -> tuple[int, dict]:
        r = httpx.get(self.url + "/health", timeout=10)
        return r.status_code, r.json()

    def wait_healthy(self, timeout_s: float, changed_pid: tuple[int, int] | None = None) -> dict:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            status, body = self.health()
            pids = {r["replica"]: r.get("pid") for r in body.get("replicas", [])}
            if status == 200 and body["status"] == "ok" and (
                    changed_pid is None or pids.get(changed_pid[0]) not in (None, changed_pid[1])):
                return body
            time.sleep(0.5)
        raise AssertionError(f"not healthy after {timeout_s}s: {self.health()}")

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rpartition(" ")[2])
        return total

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # the Ray server takes its local cluster down
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_loaded(tiny_llama(0, max_positions=1024), tmp_path_factory.mktemp("tiny-ray"))


@pytest.fixture(scope="module")
def servers(model_dir):
    """(two replicas on Ray, one process), started side by side."""
    pytest.importorskip("ray")
    started = [Server("--target", model_dir, "--replicas", "2", *SERVE_ARGS),
               Server("--target", model_dir, *SERVE_ARGS)]
    try:
        yield [server.wait_ready() for server in started]
    finally:
        for server in started:
            server.close()


@pytest.fixture(scope="module")
def ray_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def single_server(servers):
    return servers[1]


PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    '{"name": "search", "arguments": {"query": "weather in Paris"}} {"name": "search",',
]


def _user_for(replica: int, n: int = 2, start: int = 0) -> str:
    return next(f"agent-{i}" for i in range(start, 1000) if jump_hash(f"user:agent-{i}", n) == replica)


@pytest.mark.ray
@pytest.mark.slow
def test_greedy_replies_match_the_single_server(ray_server, single_server):
    accepted = 0
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        want = single_server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=40,
                                                            temperature=0)
        got = ray_server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=40,
                                                        temperature=0,
                                                        extra_body={"return_spec_decode": True})
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens
        accepted += got.model_extra["spec_decode"]["accepted"]
        stream = ray_server.client.completions.create(model="tiny", prompt=prompt, max_tokens=30,
                                                      temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        plain = single_server.client.completions.create(model="tiny", prompt=prompt, max_tokens=30,
                                                        temperature=0)
        assert streamed == plain.choices[0].text
    assert accepted > 0  # the replicas speculated


@pytest.mark.ray
@pytest.mark.slow
def test_errors_and_models_match_the_single_server(ray_server, single_server):
    requests = [
        ("POST", "/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3}),
        ("POST", "/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 100000}),
        ("GET", "/v1/nothing-here", None),
    ]
    for method, path, body in requests:
        want = httpx.request(method, single_server.url + path, json=body, timeout=30)
        got = httpx.request(method, ray_server.url + path, json=body, timeout=30)
        assert (got.status_code, got.json()) == (want.status_code, want.json()), path
        assert got.headers["x-specdec-replica"] in ("0", "1")
        assert len(got.headers.get_list("x-request-id")) == 1
    raw = httpx.post(ray_server.url + "/v1/completions", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == 400
    models = httpx.get(ray_server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "tiny"


@pytest.mark.ray
@pytest.mark.slow
def test_a_conversation_stays_on_its_replica(ray_server):
    before = ray_server.metric("specdec:replica_requests_total", route="affinity")
    conversations = [[{"role": "system", "content": f"You are agent {i}."},
                      {"role": "user", "content": PROMPTS[i % 3]}]
                     for i in range(6)]

    def run(messages) -> set[str]:
        seen = set()
        for turn in range(3):
            raw = ray_server.client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0)
            seen.add(raw.headers["x-specdec-replica"])
            messages = [*messages, {"role": "assistant", "content": raw.parse().choices[0].message.content},
                        {"role": "user", "content": f"turn {turn}"}]
        return seen

    with ThreadPoolExecutor(3) as pool:  # concurrent, below a replica's batch: no fallback
        replicas = list(pool.map(run, conversations))
    assert all(len(seen) == 1 for seen in replicas), replicas
    assert set.union(*replicas) == {"0", "1"}
    for replica in (0, 1):  # the `user` field names the conversation, whatever the messages
        user = _user_for(replica)
        for prompt in PROMPTS:
            raw = ray_server.client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=4, user=user)
            assert raw.headers["x-specdec-replica"] == str(replica)
    assert ray_server.metric("specdec:replica_requests_total", route="affinity") - before == 6 * 3 + 2 * 3
    assert ray_server.metric("specdec:generation_tokens_total", replica="0") > 0
    assert ray_server.metric("specdec:generation_tokens_total", replica="1") > 0


def _accepted(server, replica: int) -> float:
    """Requests the replica holds: decoding or queued in its own scheduler."""
    return sum(server.metric(f"specdec:num_requests_{state}", replica=str(replica))
               for state in ("running", "waiting"))


@pytest.mark.ray
@pytest.mark.slow
def test_replicas_run_at_normal_priority(ray_server):
    # Ray's default worker niceness is 15: beside any busy process the replicas would starve
    health = ray_server.wait_healthy(300)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert [os.getpriority(os.PRIO_PROCESS, r["pid"]) for r in health["replicas"]] == [ours, ours]


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_replica_fails_its_requests_cleanly_and_comes_back(ray_server):
    health = ray_server.wait_healthy(300)
    assert [r["replica"] for r in health["replicas"]] == [0, 1]
    victim = 1
    pid = next(r["pid"] for r in health["replicas"] if r["replica"] == victim)
    user = _user_for(victim)
    long = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 900,
            "temperature": 0, "user": user}
    stream = ray_server.client.chat.completions.create(**long, stream=True)
    first = next(iter(stream))  # the request is in flight on the victim
    assert first.choices[0].delta.role == "assistant"
    with ThreadPoolExecutor(1) as pool:
        plain = pool.submit(ray_server.client.chat.completions.create, **long)
        # kill only once the victim holds both: a request still queued in Ray's router when the
        # replica dies waits for its restart (minutes on busy cores) instead of failing
        deadline = time.time() + 120
        while _accepted(ray_server, victim) < 2 and time.time() < deadline:
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        with pytest.raises(openai.APIError, match="replica 1 failed"):
            for _ in stream:
                pass
        with pytest.raises(openai.APIStatusError) as failed:
            plain.result(timeout=60)
    assert failed.value.status_code == 503 and "replica 1 failed" in failed.value.message
    assert time.time() - t0 < 60  # no hang
    status, body = ray_server.health()  # the other replica still serves
    assert status == 200
    survivor = ray_server.client.chat.completions.create(model="tiny", messages=long["messages"],
                                                         max_tokens=4, user=_user_for(0))
    assert survivor.choices[0].message.content
    # hang guards: Ray restarts the replica, which loads the model again (minutes with the cores busy)
    body = ray_server.wait_healthy(600, changed_pid=(victim, pid))  # restarted by Ray: a new process
    assert all(r["status"] == "ok" for r in body["replicas"])
    deadline = time.time() + 120
    while True:  # the ingress probes the restarted replica back into rotation
        raw = ray_server.client.chat.completions.with_raw_response.create(
            model="tiny", messages=long["messages"], max_tokens=4, user=user)
        if raw.headers["x-specdec-replica"] == str(victim) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert raw.headers["x-specdec-replica"] == str(victim)
    assert ray_server.metric("specdec:replica_failures_total", replica=str(victim)) >= 2
