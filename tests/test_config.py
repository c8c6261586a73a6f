"""EngineConfig: aliases, validation, config files, and flags that override them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import save_loaded, tiny_llama
from specdec.bench.run import make_engine_runners
from specdec.cli import build_parser, engine_config, main
from specdec.config import MAX_K, EngineConfig, parse_k, read_config, split_k
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.serve.cli import serve_config
from specdec.serve.settings import ALIASES, SETTINGS, ServeConfig, default_of, reference_rows

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({}, {"target": "smollm2-135m", "drafter": "ngram", "k": "auto", "backend": "hf",
              "prefix_cache": "prompt", "verify_strategy": "rejection", "draft_device": None,
              "backend_options": {}}),
        ({"score_model": "t", "propose_model": "suffix", "num_propose_tokens": 4},
         {"target": "t", "drafter": "suffix", "k": 4}),
        ({"target": "t", "drafter": "ngram:min=1", "k": "3"},
         {"target": "t", "drafter": "ngram:min=1", "k": 3}),
        ({"model": "t"}, {"target": "t"}),  # top-level `model` is the target, as in a vLLM config file
        ({"num_speculative_tokens": 5}, {"k": 5}),
        ({"propose_model": "ngram:k=8:max=4"}, {"drafter": "ngram:max=4", "k": 8}),
        ({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5},
         {"drafter": "ngram:min=2:max=5"}),
        ({"prompt_lookup_max": 3}, {"drafter": "ngram:max=3"}),
        ({"speculative_config": {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 4}},
         {"drafter": "ngram:min=1", "k": 4}),
        ({"speculative_config": {"method": "draft_model", "model": "/d"}}, {"drafter": "model:/d"}),
        ({"speculative_config": {"model": "/d"}}, {"drafter": "model:/d"}),
        ({"method": "eagle", "speculative_config": {"model": "/e"}}, {"drafter": "eagle:/e"}),
        ({"method": "suffix"}, {"drafter": "suffix"}),
        ({"model": "t", "speculative_config": {"model": "/d", "num_speculative_tokens": 3}},
         {"target": "t", "drafter": "model:/d", "k": 3}),
        ({"k": 4, "num_propose_tokens": "4"}, {"k": 4}),  # the same value under two keys is fine
        ({"prefix_cache": False}, {"prefix_cache": "off"}),  # YAML reads `off` as false
        ({"prefix_cache": "decoded", "draft_device": "cpu"},
         {"prefix_cache": "decoded", "draft_device": "cpu"}),
        ({"backend": "native", "backend_options": {"precision": "fp32", "max_length": 512}},
         {"backend": "native", "backend_options": {"precision": "fp32", "max_length": 512}}),
        ({"verify_strategy": "greedy"}, {"verify_strategy": "greedy"}),
        ({"serve": {"port": 1}}, {"target": "smollm2-135m"}),  # serve's section is not the engine's
    ],
)
def test_keys_and_aliases(data, expected):
    config = EngineConfig.from_dict(data)
    assert {key: getattr(config, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"temperature": 0, "max_batch": 4}, "unknown config key(s): temperature, max_batch"),
        ({"speculative_config": {"method": "ngram", "draft_tensor_parallel_size": 2}},
         "unknown config key(s): speculative_config.draft_tensor_parallel_size"),
        ({"k": 4, "num_propose_tokens": 5}, "conflicting values for k: k=4, num_propose_tokens=5"),
        ({"propose_model": "ngram:k=3", "k": 4}, "conflicting values for k"),
        ({"drafter": "ngram", "propose_model": "suffix"}, "conflicting values for drafter"),
        ({"drafter": "ngram", "method": "suffix"}, "conflicting values for drafter"),
        ({"target": "a", "score_model": "b"}, "conflicting values for target"),
        ({"method": "ngram", "speculative_config": {"method": "eagle"}}, "conflicting values for method"),
        ({"method": "medusa"}, "speculative method 'medusa' is not supported"),
        ({"method": "draft_model"}, "needs speculative_config.model"),
        ({"method": "eagle", "prompt_lookup_max": 4}, "only apply to method ngram"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
        ({"method": "ngram", "speculative_config": {"model": "/d"}}, "takes no draft model"),
        ({"speculative_config": "ngram"}, "speculative_config must be a mapping"),
        ({"k": "many"}, "k must be 'auto' or an integer"),
        ({"verify_strategy": "typical"}, "verify_strategy must be one of rejection, greedy"),
        ({"prefix_cache": "all"}, "prefix_cache must be one of prompt, decoded, off"),
        ({"backend_options": ["precision=fp32"]}, "backend_options must map"),
        ({"target": 7}, "target must be a non-empty string"),
        ({"drafter": ""}, "empty drafter name"),
    ],
)
def test_bad_configs_are_one_line_errors(data, needle):
    with pytest.raises(SpecdecError) as info:
        EngineConfig.from_dict(data, source="f.yaml")
    assert info.value.message.startswith("f.yaml: ") and needle in info.value.message
    assert "\n" not in info.value.message


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", "auto"), (0, 0), ("0", 0), (7, 7), (" 5 ", 5), (MAX_K, MAX_K),
     (-1, None), (MAX_K + 1, None), ("2.5", None), ("x", None), (True, None), (2.0, None), (None, None)],
)
def test_parse_k(value, expected):
    if expected is None:
        with pytest.raises(SpecdecError, match="k must be 'auto' or an integer"):
            parse_k(value)
    else:
        assert parse_k(value) == expected


def test_split_k():
    assert split_k("ngram") == ("ngram", None)
    assert split_k("ngram:k=4:min=1") == ("ngram:min=1", 4)
    assert split_k("model:/tmp/a:b:k=auto") == ("model:/tmp/a:b", "auto")
    assert split_k("hybrid:ngram:max=4+eagle:DIR:k=3") == ("hybrid:ngram:max=4+eagle:DIR", 3)  # order kept
    with pytest.raises(SpecdecError, match="k must be"):
        split_k("ngram:k=-2")


def test_override_keeps_the_rest_and_takes_a_drafters_k():
    base = EngineConfig(target="t", drafter="suffix", k=4, backend="native")
    assert base.override(drafter="ngram") == EngineConfig(target="t", drafter="ngram", k=4, backend="native")
    assert base.override(drafter="ngram:k=8").k == 8  # a new drafter's own k replaces the old k
    assert base.override(k=None, backend=None) == base  # None means "not given"
    with pytest.raises(SpecdecError, match="k is given twice"):
        EngineConfig(drafter="ngram:k=8", k=4)


def write(tmp_path, text: str) -> str:
    path = tmp_path / "specdec.yaml"
    path.write_text(text)
    return str(path)


def test_cli_flags_override_the_file(tmp_path):
    path = write(tmp_path, "score_model: t\npropose_model: suffix\nnum_propose_tokens: 4\nbackend: native\n"
                           "backend_options: {precision: fp32, max_length: 512}\nprefix_cache: decoded\n")
    parse = build_parser().parse_args
    args = parse(["generate", "--prompt", "x", "--config", path])
    assert engine_config(args) == EngineConfig(target="t", drafter="suffix", k=4, backend="native",
                                               backend_options={"precision": "fp32", "max_length": 512},
                                               prefix_cache="decoded")
    args = parse(["generate", "--prompt", "x", "--config", path, "--drafter", "ngram:k=2", "--backend", "hf",
                  "--backend-option", "precision=bf16", "--prefix-cache", "off",
                  "--verify-strategy", "greedy"])
    assert engine_config(args) == EngineConfig(target="t", drafter="ngram", k=2, backend="hf",
                                               backend_options={"precision": "bf16", "max_length": 512},
                                               prefix_cache="off", verify_strategy="greedy")
    args = parse(["generate", "--prompt", "x", "--config", path, "--k", "auto", "--target", "u"])
    assert (engine_config(args).k, engine_config(args).target) == ("auto", "u")
    # without a file, the defaults are EngineConfig's, but the backend is auto's choice: native
    # for the default target (a Llama)
    assert engine_config(parse(["generate", "--prompt", "x"])) == EngineConfig(backend="native")
    assert engine_config(parse(["bench", "--methods", "none"])) == EngineConfig(backend="native")
    assert engine_config(parse(["distill", "--out", "o", "--config", path])).target == "t"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("k: 4\nbogus: 1\n", "unknown config key(s): bogus"),
        ("- a\n- b\n", "must be a mapping"),
        ("k: [\n", "not valid YAML at line"),
        ("backend: tpu\n", "unknown backend 'tpu'"),
    ],
)
def test_bad_config_file_exits_2(capsys, tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--config", path])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_missing_config_file_exits_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--config", str(tmp_path / "nope.yaml")])
    assert exc.value.code == 2 and "nope.yaml" in capsys.readouterr().err


def test_generate_with_a_config_file(capsys, tmp_path):
    target = save_loaded(tiny_llama(seed=0), tmp_path / "tiny")
    path = write(tmp_path, f"score_model: {target}\npropose_model: ngram:min=1\nnum_propose_tokens: 3\n")
    argv = ["generate", "--config", path, "--prompt", "def add(a, b):", "--raw", "--max-new-tokens", "12",
            "--json"]
    main([*argv, "--compare-plain"])
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["drafter"] == "ngram:min=1" and len(data["token_ids"]) == 12
    assert data["stats"]["matches_plain"] is True and max(data["stats"]["accepted_per_pos"] or [0]) >= 0
    main([*argv, "--drafter", "none"])  # the flag wins over the file
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["drafter"] == "none" and plain["token_ids"] == data["token_ids"]


def test_serve_config_from_a_file(tmp_path, monkeypatch):
    path = write(tmp_path, "score_model: t\npropose_model: suffix\nnum_propose_tokens: auto\n"
                           "backend: native\n"
                           "serve:\n  port: 9001\n  max_batch: 4\n  allow_drafters: ngram:min=1\n"
                           "  api_key_env: TEST_KEY\n  log_level: info\n  request_timeout: 30\n")
    monkeypatch.setenv("TEST_KEY", "secret")
    args = build_parser().parse_args(["serve", "--config", path, "--max-queue", "3", "--port", "9002"])
    config = serve_config(args)
    assert config.engine == EngineConfig(target="t", drafter="suffix", backend="native",
                                         backend_options={"slots": 4})  # one cache slot per batched request
    assert (config.max_batch, config.max_queue, config.request_timeout) == (4, 3, 30.0)
    assert config.allow_drafters == ["ngram:min=1"] and config.api_key == "secret"
    assert config.model_name == "t" and config.max_batch_tokens == 40  # the cpu default
    assert (config.port, config.host, config.log_level) == (9002, "127.0.0.1", "info")


@pytest.mark.parametrize(
    ("serve", "needle"),
    [
        ("  workers: 4\n", "unknown serve key(s): workers"),
        ("  port: -1\n", "serve.port: must be >= 0"),
        ("  max_batch: many\n", "serve.max_batch: expected an integer"),
        ("  log_level: loud\n", "serve.log_level: must be one of"),
        ("  allow_drafters: {a: 1}\n", "serve.allow_drafters"),
    ],
)
def test_bad_serve_section(tmp_path, serve, needle):
    path = write(tmp_path, "target: t\nserve:\n" + serve)
    with pytest.raises(SpecdecError, match=None) as info:
        serve_config(build_parser().parse_args(["serve", "--config", path]))
    assert needle in info.value.message


def test_deprecated_serve_names_warn_and_still_work(tmp_path):
    path = write(tmp_path, "target: t\nbackend: native\n"
                           "serve:\n  tool_parser: json\n  allow_drafter: [ngram:min=1]\n")
    with pytest.warns(DeprecationWarning,
                      match="serve.tool_parser is deprecated; use serve.tool_call_parser"):
        config = serve_config(build_parser().parse_args(["serve", "--config", path]))
    assert (config.tool_call_parser, config.allow_drafters) == ("json", ["ngram:min=1"])
    with pytest.warns(DeprecationWarning, match="--allow-drafter is deprecated; use --allow-drafters"):
        args = build_parser().parse_args(["serve", "--target", "t", "--backend", "native",
                                          "--allow-drafter", "a", "--allow-drafters", "b"])
    assert serve_config(args).allow_drafters == ["a", "b"]


def test_every_serve_setting_is_a_flag_and_a_file_key(tmp_path):
    # ServeConfig is the one source: each setting field has its flag and its `serve:` key
    flags = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    for name, default in [(n, default_of(n)) for n in SETTINGS]:
        assert name in flags and flags[name].default is None, name
        assert getattr(ServeConfig(), name) == default
    assert [row[0] for row in reference_rows()] == list(SETTINGS)
    assert not set(ALIASES.values()) - set(SETTINGS)


def test_example_configs_parse():
    agents = read_config(EXAMPLES / "agents.yaml")
    assert EngineConfig.from_dict(agents) == EngineConfig(drafter="suffix", backend="native")
    args = build_parser().parse_args(["serve", "--config", str(EXAMPLES / "agents.yaml")])
    config = serve_config(args)
    assert config.engine.drafter == "suffix" and config.port == 8000
    assert EngineConfig.from_yaml(EXAMPLES / "bench.yaml").drafter == "suffix"


def test_engine_takes_a_config():
    target = tiny_llama(seed=0)
    config = EngineConfig(drafter="ngram:min=1", k=3, prefix_cache="off")
    engine = Engine(target, config=config)
    assert (engine.k, engine.drafter_name, engine.config.prefix_cache) == (3, "ngram:min=1", "off")
    assert engine.config.target == target.name
    assert Engine(target, "ngram:k=5").k == 5
    assert Engine(target, "ngram", config=config).k == 3  # the drafter changes, config's k stays
    with pytest.raises(SpecdecError, match="k is given twice"):
        Engine(target, "ngram:k=5", k=4)
    runners = make_engine_runners(target, ["none", "ngram", "ngram:k=8"], EngineConfig(k=2))
    assert [r.engine.k for r in runners] == [0, 2, 8]


def test_greedy_verify_strategy_decodes_greedily():
    target = tiny_llama(seed=0)
    ids = target.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick")
    plain = Engine(target, "none", k=0).generate(ids, max_new_tokens=20)
    greedy = Engine(target, "ngram:min=1", k=3, verify_strategy="greedy")
    assert greedy.generate(ids, max_new_tokens=20, temperature=1.0, seed=3).token_ids == plain.token_ids
