"""The CLI: one-line errors with exit status 2, and the --json contract."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from conftest import save_loaded, tiny_llama
from specdec.cli import build_parser, generate_request, main


def run(capsys, *argv):
    capsys.readouterr()  # drop what the test's own setup printed
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prompt", "hi", "--target", "no-such-model"], "unknown model"),
        (["--prompt", "hi", "--drafter", "telepathy"], "unknown drafter"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "must be >= 1"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--k", "many"], "k must be"),
        (["--prompt", ""], "prompt is empty"),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, argv, needle):
    target = save_loaded(tiny_llama(seed=0), tmp_path / "tiny")
    if "--target" not in argv:
        argv = [*argv, "--target", target]
    code, out, err = run(capsys, "generate", *argv)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_prompt_longer_than_context(capsys, tmp_path):
    target = save_loaded(tiny_llama(seed=0, max_positions=32), tmp_path / "tiny")
    code, _, err = run(capsys, "generate", "--target", target, "--raw", "--prompt", "fox " * 100)
    assert code == 2 and "maximum context length" in err


def test_json_last_line(capsys, tmp_path):
    target = save_loaded(tiny_llama(seed=0), tmp_path / "tiny")
    main(["generate", "--target", target, "--prompt", "def add(a, b):", "--raw", "--max-new-tokens", "12",
          "--drafter", "ngram:min=1", "--json", "--compare-plain"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    data = json.loads(last)
    assert set(data) >= {"text", "token_ids", "finish_reason", "stats"}
    assert set(data["stats"]) >= {
        "steps", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
        "tokens_per_second", "wall_time_s",
    }
    assert len(data["token_ids"]) == 12 and data["finish_reason"] == "length"
    assert data["stats"]["matches_plain"] is True


# ---- structured output and tools -------------------------------------------------------------

SCHEMA = {"type": "object",
          "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"}},
          "required": ["unit", "ok"], "additionalProperties": False}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 6}}, "required": ["query"],
    "additionalProperties": False}}}
MESSAGES = [
    {"role": "user", "content": "Search the weather."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "search", "arguments": '{"query": "sun"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model with room for a tool list, and the JSON files the flags read."""
    root = tmp_path_factory.mktemp("cli")
    paths = {"target": save_loaded(tiny_llama(seed=0, max_positions=1024), root / "tiny")}
    contents = {
        "schema": json.dumps(SCHEMA), "tools": json.dumps([SEARCH]), "messages": json.dumps(MESSAGES),
        "badjson": "[{oops", "badtool": json.dumps([{"type": "function", "function": {"name": "two words"}}]),
        "badschema": json.dumps({"type": "object", "properties": 3}), "empty": "[]",
    }
    for name, text in contents.items():
        (root / f"{name}.json").write_text(text)
        paths[name] = str(root / f"{name}.json")
    paths["missing"] = str(root / "missing.json")
    return paths


def _args(files, *argv):
    return [a.format(**files) for a in argv]


def test_json_schema_constrains_the_reply(capsys, files):
    main(_args(files, "generate", "--target", "{target}", "--prompt", "Weather?", "--json-schema", "{schema}",
               "--drafter", "ngram:min=1", "--max-new-tokens", "40", "--json", "--compare-plain"))
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    reply = json.loads(data["text"])
    assert (set(reply) == {"unit", "ok"} and reply["unit"] in ("celsius", "fahrenheit")
            and isinstance(reply["ok"], bool))
    assert data["finish_reason"] == "stop" and data["stats"]["matches_plain"] is True
    assert data["stats"]["forced_tokens"] > 0  # the keys and the rest of an enum value


@pytest.mark.parametrize("source", [("--prompt", "Search the weather."), ("--messages", "{messages}")])
def test_tools_print_the_calls(capsys, files, source):
    main(_args(files, "generate", "--target", "{target}", *source, "--tools", "{tools}",
               "--tool-choice", "search", "--no-parallel-tool-calls", "--drafter", "ngram:min=1",
               "--max-new-tokens", "80", "--compare-plain"))
    lines = capsys.readouterr().out.strip().splitlines()
    call = json.loads(lines[0])
    assert (call["name"] == "search" and set(call["arguments"]) == {"query"}
            and len(call["arguments"]["query"]) <= 6)
    assert ", forced " in lines[-2] and "finish tool_calls" in lines[-2]
    assert (lines[-1].startswith("[plain decoding, one token per forward]")
            and lines[-1].endswith("identical output: True"))


def test_tools_json_output(capsys, files):
    main(_args(files, "generate", "--target", "{target}", "--prompt", "Search.", "--tools", "{tools}",
               "--tool-choice", "required", "--max-new-tokens", "80", "--json"))
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["finish_reason"] == "tool_calls" and data["content"] is None
    assert ([c["function"]["name"] for c in data["tool_calls"]] == ["search"]
            and data["stats"]["forced_tokens"] > 0)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--tools", "{missing}"], "--tools {missing}: No such file or directory"),
        (["--tools", "{badjson}"], "--tools {badjson}: not JSON"),
        (["--tools", "{badtool}"], "tools[0].function.name: must be"),
        (["--tools", "{tools}", "--tool-choice", "lookup"], "no tool is named 'lookup'"),
        (["--tool-choice", "required"], "need --tools"),
        (["--json-schema", "{badjson}"], "--json-schema {badjson}: not JSON"),
        (["--json-schema", "{badschema}"], "--json-schema {badschema}: invalid json schema"),
        (["--json-schema", "{schema}", "--tools", "{tools}", "--tool-choice", "required"],
         "cannot be combined"),
        (["--messages", "{empty}"], "expected a non-empty list of chat messages"),
        (["--messages", "{messages}", "--raw"], "--raw applies to --prompt"),
        (["--messages", "{messages}", "--prompt", "hi"], "not allowed with argument"),
    ],
)
def test_bad_structure_files_are_one_line(capsys, files, argv, needle):
    argv = _args(files, *argv)
    if "--messages" not in argv:
        argv = ["--prompt", "hi", *argv]
    code, _, err = run(capsys, "generate", "--target", files["target"], *argv)
    assert code == 2 and needle.format(**files) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_make_run_request_is_valid(monkeypatch):
    """`make run`'s REQUEST (examples/agent_turn.json, examples/tools.json) is read and checked
    as generate reads it, before any model is loaded."""
    root = Path(__file__).resolve().parents[1]
    line = next(ln for ln in (root / "Makefile").read_text().splitlines() if ln.startswith("REQUEST ?= "))
    args = build_parser().parse_args(["generate", *shlex.split(line.removeprefix("REQUEST ?= "))])
    monkeypatch.chdir(root)  # the paths are relative to the repository, as make runs them
    request = generate_request(args)
    prompt, plan = request.prompt, request.tools
    assert prompt[-1]["role"] == "user" and any(m.get("tool_calls") for m in prompt)
    assert plan.choice == "required" and plan.parallel is False
    assert {t["function"]["name"] for t in plan.tools} == {"get_weather", "search_contacts", "send_email",
                                                          "create_event"}


def test_the_cli_loads_without_dynamo_onnx_or_transformers_model_code():
    """Every process start pays for what `specdec.cli` imports (each server, replica and
    command): Dynamo, onnx and transformers' model classes wait until something uses them."""
    import subprocess
    import sys

    heavy = ("torch._dynamo", "onnx", "transformers.modeling_utils", "specdec.backends.hf")
    code = f"import sys, specdec.cli, specdec.serve.app; print([m for m in {heavy!r} if m in sys.modules])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
