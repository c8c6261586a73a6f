"""What the server test modules share: a real `specdec serve` process (`ServerProcess`), the
module-scoped fixtures of the main test server (tiny random model, API key, traffic log), the
prompts, the OpenAI error-shape check and a JSON strategy for fuzzing request bodies.

A module that imports a fixture from here gets its own module-scoped instance of it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import strategies as st

from conftest import save_loaded, tiny_llama

KEY = "sk-test-key"
TESTS = str(Path(__file__).parent)
MODEL = "tiny"


class ServerProcess:
    """A real `specdec serve` on a free port. The tiny random models run on the hf backend by
    default (what their expected replies are computed with); pass backend="auto" for the
    server's own default."""

    def __init__(self, model_dir: str, *args: str, env: dict | None = None, backend: str = "hf",
                 plugin: str | None = None, ready_timeout: float = 120):
        """`plugin`: a module of tests/ imported before the server starts (it may register a drafter);
        `ready_timeout`: seconds from listening to ready (a real model loads for minutes on a busy
        machine)."""
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        if "--backend" not in args:
            args = ("--backend", backend, *args)
        boot = f"import sys; sys.path.insert(0, {TESTS!r}); import {plugin}; " if plugin else "import sys; "
        boot += "from specdec.cli import main; main(sys.argv[1:])"
        cmd = [sys.executable, "-c", boot, "serve", "--target", model_dir, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=full_env)
        self.lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(180):  # importing torch takes long on a loaded machine
            self.close()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        port = re.search(r"http://127\.0\.0\.1:(\d+)", "".join(self.lines)).group(1)
        self.url = f"http://127.0.0.1:{port}"
        self.health: list[tuple[int, dict]] = []  # (status, body) seen while waiting for ready
        deadline = time.time() + ready_timeout
        while time.time() < deadline:
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                self.health.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.close()
        raise RuntimeError("server did not become ready:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on" in line:
                self._listening.set()

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def metrics(self) -> dict[str, float]:
        """Sample name (labels included, model_name left out: every sample must carry it) -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("specdec:"):
                name, _, value = line.rpartition(" ")
                assert re.search(r'model_name="[^"]+"', name), line
                name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
                values[name] = float(value)
        return values


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_loaded(tiny_llama(0), tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("traffic"))


@pytest.fixture(scope="module")
def server(model_dir, log_dir):
    srv = ServerProcess(
        model_dir, "--served-model-name", MODEL, "--api-key-env", "SPECDEC_TEST_KEY",
        "--drafter", "ngram:min=1", "--max-batch", "8", "--log-dir", log_dir,
        env={"SPECDEC_TEST_KEY": KEY, "SPECDEC_SERVE_LOAD_DELAY": "1.0"},
    )
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    '{"name": "search", "arguments": {"query": "weather in Paris"}} {"name": "search",',
    "| name | value |\n|------|-------|\n| a | 1 |\n| b |",
]


def assert_error_shape(body: dict, status: int) -> dict:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    # not rewritten here
    assert err["code"] == status and isinstance(err["message"], str) and err["message"], err
    return err


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
