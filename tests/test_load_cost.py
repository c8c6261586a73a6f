"""scripts/bench/measure/load_cost.py's arithmetic on made-up stage records (no model is loaded): RSS
above the runtime's baseline, the tokenizer's share, the bound and the medians."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "measure" / "load_cost.py"


def run_record(baseline: float, tokenizer: float, weights: float, seconds: float) -> dict:
    """One process's stages (RSS MB after each, seconds each), as `child` returns them."""
    stages = [["python", 10.0, 0.0], ["import torch", 200.0, 1.0], ["import specdec", 280.0, 1.0],
              ["import transformers (tokenizers)", 300.0, 1.0], ["compiled kernels (numba)", baseline, 1.0],
              ["tokenizer", baseline + tokenizer, 0.5],
              ["weights + KV cache (make_backend)", baseline + tokenizer + weights, seconds],
              ["first prefill (37 tokens)", baseline + tokenizer + weights + 5, 0.1],
              ["one decode step", baseline + tokenizer + weights + 6, 0.1]]
    return {"stages": stages, "file_MB": 100.0, "kv_MB": 50.0, "kv_tokens": 4096}


@pytest.mark.parametrize(("tokenizer", "weights", "within"), [(20.0, 150.0, "yes"), (20.0, 175.0, "yes"),
                                                               (60.0, 150.0, "**no**")])
def test_a_file_row_counts_rss_above_the_baseline_against_the_bound(tokenizer, weights, within):
    script = runpy.run_path(str(SCRIPT))
    runs = [run_record(400.0, tokenizer, weights, s) for s in (3.0, 9.0, 4.0)]  # median seconds: 4
    row = dict(zip(script["FILE_COLUMNS"], script["file_row"]("dir/model.gguf", runs), strict=True))
    assert row["File"] == "model.gguf"
    assert row["Load s (tokenizer + weights)"] == "**4.50** (0.50 + 4.00)"
    assert row["RSS: tokenizer MB"] == f"{tokenizer:.1f}" and row["RSS: weights + KV MB"] == f"{weights:.1f}"
    assert row["RSS above baseline MB"] == f"**{tokenizer + weights:.1f}**"
    assert row["1.3 x (file + KV) MB"] == "195.0" and row["Within"] == within


def test_the_stage_table_gives_each_stage_its_own_change():
    script = runpy.run_path(str(SCRIPT))
    rows = script["stage_rows"]([run_record(400.0, 20.0, 150.0, 4.0)])
    assert [r[0] for r in rows][-3:] == ["weights + KV cache (make_backend)", "first prefill (37 tokens)",
                                          "one decode step"]
    assert (rows[0][2] == "+10.0"
            and rows[6] == ["weights + KV cache (make_backend)", "570.0", "+150.0", "4.00"])
