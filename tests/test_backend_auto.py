"""`--backend auto`: native where the native backend runs the target's architecture, else hf;
decided from the model's files before its weights load, and again from a loaded model."""

from __future__ import annotations

import json

import pytest

from conftest import save_loaded, tiny_llama, tiny_tokenizer
from specdec.backends import make_backend
from specdec.backends.auto import backend_for, resolve_backend
from specdec.backends.hf import HFBackend
from specdec.backends.native.model.sequence import NativeSequence
from specdec.cli import build_parser, engine_config
from specdec.models import LoadedModel


def tiny_gpt2() -> LoadedModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=1, n_head=2)
    return LoadedModel(name="tiny-gpt2", model=GPT2LMHeadModel(config).eval(), tokenizer=tok)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_loaded(tiny_llama(seed=0), tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize(("model_type", "expected"), [
    ("llama", "native"),
    ("qwen2", "native"),
    ("mistral", "native"),
    ("qwen3", "native"),
    ("gemma3_text", "native"),
    ("phi3", "native"),
    ("gpt2", "hf"),
    ("gemma3", "hf"),
])
def test_auto_picks_by_the_directory_architecture(tmp_path, model_type, expected):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert resolve_backend("auto", str(tmp_path)) == expected


def test_auto_falls_back_to_hf_for_a_feature_native_lacks(tmp_path, caplog):
    """A supported type with a rope native does not compute (phi3's longrope) runs on hf, and says why."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
            "long_factor": [2.0] * 16, "original_max_position_embeddings": 64}
    config = {"model_type": "phi3", "hidden_size": 128, "num_attention_heads": 4, "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="specdec"):
        assert resolve_backend("auto", str(tmp_path)) == "hf"
    assert "longrope" in caplog.text
    assert resolve_backend("hf", str(tmp_path)) == "hf"  # a named backend is kept as it is


def test_auto_reads_the_builtin_gguf_architecture():
    assert resolve_backend("auto", "smollm2-135m") == "native"


def test_auto_builds_native_for_a_llama_and_hf_otherwise():
    llama, gpt2 = tiny_llama(seed=0), tiny_gpt2()
    assert backend_for(llama) == "native" and backend_for(gpt2) == "hf"
    assert isinstance(make_backend("auto", llama), NativeSequence)
    assert isinstance(make_backend("auto", gpt2), HFBackend)


def test_auto_is_the_command_line_default(llama_dir, tmp_path):
    parse = build_parser().parse_args
    assert engine_config(parse(["generate", "--prompt", "x", "--target", llama_dir])).backend == "native"
    assert engine_config(parse(["generate", "--prompt", "x", "--target", llama_dir,
                                "--backend", "hf"])).backend == "hf"
    config = tmp_path / "c.yaml"
    config.write_text(f"target: {llama_dir}\nbackend: hf\n")
    # the file's choice stands
    assert engine_config(parse(["bench", "--config", str(config)])).backend == "hf"
    assert "auto" in build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
