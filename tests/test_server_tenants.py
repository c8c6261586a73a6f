"""Tenants and the gateway's own settings, without a server: API key files, tenant ids, the
serve flags and config keys of issue 16, and where a request's unencodable text is."""

from __future__ import annotations

import pytest

from specdec.cli import build_parser
from specdec.errors import SpecdecError
from specdec.serve.cli import serve_config
from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest, unencodable_field
from specdec.serve.tenants import key_tenant, read_api_keys, request_tenant


def test_an_api_key_file_maps_keys_to_tenants(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# production keys\nsk-a  team-a\n\n  sk-b team.b@corp\nsk-c\n")
    keys = read_api_keys(str(path))
    assert keys == {"sk-a": "team-a", "sk-b": "team.b@corp", "sk-c": key_tenant("sk-c")}
    assert keys["sk-c"].startswith("key-") and "sk-c" not in keys["sk-c"]  # the key is not revealed


@pytest.mark.parametrize(("text", "needle"), [
    ("", "no keys in the file"),
    ("# only a comment\n", "no keys in the file"),
    ("sk-a a\nsk-a b\n", "line 2: this key is listed twice"),
    ("sk-a team a\n", "line 1: expected 'KEY [TENANT]', got 3 fields"),
    ("sk-a te#am\n", "line 1: a tenant name is"),
])
def test_bad_api_key_files(tmp_path, text, needle):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(SpecdecError) as info:
        read_api_keys(str(path))
    assert needle in info.value.message and info.value.param == "api_key_file"
    with pytest.raises(SpecdecError, match="--api-key-file"):
        read_api_keys(str(tmp_path / "missing"))


def test_cache_salt_splits_a_tenant_and_is_not_shown():
    assert request_tenant("alice", None) == "alice"
    salted = request_tenant("alice", "secret-salt")
    assert salted.startswith("alice#salt-") and "secret" not in salted
    assert salted == request_tenant("alice", "secret-salt") != request_tenant("alice", "other")
    assert request_tenant("bob", "secret-salt") != salted
    assert request_tenant("", "s").startswith("#salt-")


def test_serve_flags_and_config_keys(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("sk-a alice\n")
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("target: smollm2-135m\nserve:\n"
                           "  allowed_origins: [http://a.example, http://b.example]\n"
                           "  access_log: \"off\"\n  shutdown_timeout: 5\n  api_key_env: TEST_KEY\n")
    monkeypatch.setenv("TEST_KEY", "sk-env")
    args = build_parser().parse_args(["serve", "--config", str(config_file), "--api-key-file", str(keys)])
    config = serve_config(args)
    assert config.allowed_origins == ["http://a.example", "http://b.example"]
    assert (config.access_log, config.shutdown_timeout) == ("off", 5.0)
    assert config.keys() == {"sk-a": "alice", "sk-env": key_tenant("sk-env")}
    config = serve_config(build_parser().parse_args(["serve", "--target", "smollm2-135m",
                                                     "--allowed-origins", "*"]))
    assert config.allowed_origins == ["*"] and config.access_log == "json" and config.keys() == {}
    with pytest.raises(SystemExit):  # argparse: the flag's value is checked
        build_parser().parse_args(["serve", "--shutdown-timeout", "0"])


@pytest.mark.parametrize(("model", "body", "param"), [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "ok"}]}, None),
    (ChatCompletionRequest,
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "é\ud800"}]}]},
     "messages[0].content[0].text"),
    (ChatCompletionRequest,
     {"messages": [{"role": "user", "content": "ok"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"\udc00": {}}}}]},
     "tools[0].function.parameters"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "ok"}], "tool_choice": "\ud83d"},
     "tool_choice"),
    (CompletionRequest, {"prompt": ["ok", "😀", "x\udfff"]}, "prompt[2]"),
    (CompletionRequest, {"prompt": "😀 is a whole pair"}, None),
])
def test_unencodable_field_names_the_first_bad_string(model, body, param):
    assert unencodable_field(model.model_validate(body)) == param
