"""The soak test (tests/soak.py, also a script for any server): 64 concurrent clients
against a real `specdec serve` process, with random disconnects, long and short prompts
mixed and malformed requests mixed in. It passes with no 5xx, every completed greedy reply
equal to its prompt's reply served alone, /health ok afterwards and RSS back within a bound;
it prints the report, inter-token latency p99 of running streams included.

The model is the tiny random Llama with a 4096-token context, so long prompts (a few thousand
tokens) go through chunked prefill. Marked `soak` (and `slow`): minutes on a 2-core machine.
"""

from __future__ import annotations

import json

import pytest

import soak
from conftest import save_loaded, tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.soak]


def test_64_streamed_clients_soak(tmp_path):
    model_dir = save_loaded(tiny_llama(0, max_positions=4096), tmp_path / "tiny")
    settings = soak.Settings(clients=64, rounds=3, rss_bound_mb=100)  # a slot of this model holds ~2 MB
    server = soak.ServerProcess(model_dir, ["--served-model-name", settings.model, "--drafter", "ngram:min=1",
                                            "--max-batch", "16", "--max-queue", "256"])
    try:
        report = soak.run(server.url, server.proc.pid, settings)
    finally:
        exit_code = server.close()
    report["server_tracebacks"] = server.tracebacks
    print(json.dumps(report))
    assert report["passed"], json.dumps(report, indent=1) + "\n" + "".join(server.lines[-60:])
    assert not any(code.isdigit() and int(code) >= 500 for code in report["statuses"])
    modes = report["modes"]
    assert modes.get("malformed") and modes.get("drop") and modes.get("give_up")  # each kind happened
    assert report["completed_equal_to_alone"] > 0 and report["dropped"] > 0
    assert report["itl_ms"]["n"] > 100 and report["itl_ms"]["p99"] is not None
    assert exit_code == 0  # SIGTERM: a graceful exit
