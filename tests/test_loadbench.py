"""The concurrency benchmark against a real server process: every configuration runs, and
greedy replies are checked to be identical across concurrency and speculation settings."""

from __future__ import annotations

import json

from conftest import save_loaded, tiny_llama
from specdec.bench import load as loadbench


def test_loadbench_runs_every_configuration_and_checks_greedy_replies(tmp_path, capsys, monkeypatch):
    model_dir = save_loaded(tiny_llama(0, max_positions=2048), tmp_path / "model")
    out = tmp_path / "load.json"
    pauses = []

    async def think(seconds):  # recorded, not slept
        pauses.append(seconds)

    monkeypatch.setattr(loadbench, "think", think)
    loadbench.main([
        "--target", str(model_dir), "--drafter", "ngram:min=1", "--concurrency", "1,2", "--sessions", "3",
        "--turns", "2", "--max-tokens", "12", "--think", "2.5", "--out", str(out),
    ])
    assert pauses == [2.5] * 3 * 4  # between the two turns of 3 sessions, in 4 configurations
    summary = json.loads(out.read_text())
    rows = summary["results"]
    assert ([(r["speculation"], r["concurrency"]) for r in rows]
            == [(True, 1), (True, 2), (False, 1), (False, 2)])
    assert all(r["requests"] == 6 and r["tokens"] > 0 for r in rows)
    assert all(r["exact_match"] == "6/6" for r in rows)  # nothing lost or mixed between requests
    assert rows[0]["tau"] is not None and rows[2]["tau"] == 1.0
    printed = capsys.readouterr().out
    assert "| on | 2 |" in printed
    # where the server's time went, from its /metrics: busy, decode steps' rows (drafted ones too)
    assert "where the specdec servers' time went" in printed
    for r in rows:
        assert 0 < r["busy_share"] <= 1.5 and 0 <= r["prefill_share"] < 1, r
        assert r["seqs_per_step"] >= 1 and r["kv_mb_per_step"] >= 0
    assert all(r["rows_per_step"] >= r["seqs_per_step"] for r in rows[:2])  # and any drafted rows
    assert all(r["rows_per_step"] == r["seqs_per_step"] for r in rows[2:])  # plain: one row a request
