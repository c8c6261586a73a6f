"""The CLI: one-line errors with exit status 2, and the --json contract."""

from __future__ import annotations

import json

import pytest

from conftest import save_loaded, tiny_llama
from specdec.cli import main


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
