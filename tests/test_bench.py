"""`specdec bench`: question loading, the interleaved runner, the losslessness check, the
Spec-Bench speedup arithmetic, the report files and the CLI's bad-input errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import save_loaded, tiny_llama
from specdec.bench import run as bench
from specdec.bench.cli import finish
from specdec.bench.peers import llamacpp_available, make_peers, parse_peers
from specdec.bench.report import markdown, write_report
from specdec.bench.run import BenchRun, Question, TurnRecord, load_questions, parse_methods, run_benchmark
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.verify import VerifyResult

QUESTIONS = [
    Question(1, "code_writing", ["def add(a, b):"]),
    Question(2, "agent_sessions", ["Call search.", 'Tool result: {"name": "search"}']),
    Question(3, "code_writing", ["The quick brown fox"]),
]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(seed=1)


def _run(target, methods, **kw):
    runners = bench.make_engine_runners(target, methods)
    return run_benchmark(target, QUESTIONS, runners, max_new_tokens=12, progress=False, log=lambda m: None,
                         **kw)


# ---- shipped set ----------------------------------------------------------------------------


SHIPPED_CATEGORIES = (
    "code_writing", "code_editing", "tool_calls", "agent_sessions", "tool_sessions", "translation",
    "summarization", "rag", "math", "writing",
)


def test_shipped_set_has_every_category_and_agent_sessions():
    questions = load_questions()
    by_cat = {c: [q for q in questions if q.category == c] for c in SHIPPED_CATEGORIES}
    assert set(q.category for q in questions) == set(SHIPPED_CATEGORIES)
    assert all(len(qs) >= 8 for qs in by_cat.values()), {c: len(qs) for c, qs in by_cat.items()}
    sessions = by_cat["agent_sessions"]
    assert all(3 <= len(q.turns) <= 4 for q in sessions)
    assert all(t.startswith("Tool result:") for q in sessions for t in q.turns[1:])
    for q in by_cat["summarization"] + by_cat["rag"]:
        assert len(q.turns[0].split()) >= 250, q.question_id
    tool_sessions = by_cat["tool_sessions"]
    assert all(q.session is not None and len(q.session.turns) >= 3 for q in tool_sessions)
    tool_sets = [json.dumps(q.session.tools, sort_keys=True) for q in tool_sessions]
    assert max(tool_sets.count(t) for t in tool_sets) >= 2  # sessions share a tool set
    turns = [t for q in tool_sessions for t in q.session.turns]
    assert sum(t.must_call for t in turns) >= 24 and all(t.result is not None for t in turns if t.must_call)
    assert {"required", "auto"} <= {t.tool_choice for t in turns if isinstance(t.tool_choice, str)}
    assert any(isinstance(t.tool_choice, dict) for t in turns)  # named choices
    assert len(load_questions(limit=1)) == len(SHIPPED_CATEGORIES)
    assert {q.category for q in load_questions(categories=["math", "rag"])} == {"math", "rag"}


# ---- methods ----------------------------------------------------------------------------------


def test_parse_methods_puts_baseline_first_and_validates():
    assert parse_methods("ngram,ngram:k=8") == ["none", "ngram", "ngram:k=8"]
    assert parse_methods("ngram,none") == ["none", "ngram"]
    with pytest.raises(SpecdecError, match="unknown method 'bogus'"):
        parse_methods("none,bogus")
    with pytest.raises(SpecdecError, match="listed twice"):
        parse_methods("ngram,ngram")
    with pytest.raises(SpecdecError, match="k must be"):
        parse_methods("ngram:k=x")
    with pytest.raises(SpecdecError, match="unknown model"):
        parse_methods("model:/no/such/dir")


def test_parse_peers_defaults_and_skips():
    assert parse_peers("none", ["none"], "x") == ([], [])
    assert parse_peers("hf", ["none", "model:x"], "x")[0] == ["hf"]
    default, _ = parse_peers(None, ["none", "ngram"], "smollm2-135m")
    assert default[:2] == ["hf", "hf-pld"] and "hf-assisted" not in default
    peers, notes = parse_peers("hf,llamacpp", ["none"], "/not/a/gguf/dir")
    assert peers == ["hf"] and len(notes) == 1 and "llamacpp peer skipped" in notes[0]


# ---- the run ----------------------------------------------------------------------------------


def test_run_matches_baseline_and_writes_every_output(target, draft, tmp_path):
    # model:<target name> drafts with the target itself: every draft must be accepted.
    draft_dir = save_loaded(draft, tmp_path / "draft")
    # the target drafting for itself, on the target's backend (hf): every draft is accepted
    methods = ["none", "ngram", f"model:{target.name}:k=3:backend=hf", f"model:{draft_dir}"]
    peer_names, notes = parse_peers(None, methods, target.name)
    assert peer_names[:3] == ["hf", "hf-pld", "hf-assisted"]
    runners = bench.make_engine_runners(target, methods)
    runners += make_peers(peer_names[:3], target, target.name, methods, {r.name: r.engine for r in runners})
    run = run_benchmark(target, QUESTIONS, runners, max_new_tokens=12, progress=False, log=lambda m: None)
    assert run.mismatches == []
    results = write_report(run, tmp_path, {"max_new_tokens": 12})
    assert results["baseline"] == "none"
    assert (set(results["methods"]) == set(methods)
            and set(results["peers"]) == {"hf", "hf-pld", "hf-assisted"})
    n_turns = sum(len(q.turns) for q in QUESTIONS)
    for entry in [*results["methods"].values(), *results["peers"].values()]:
        assert entry["exact_match"] == f"{n_turns}/{n_turns}"
        for key in ("speedup", "tokens_per_second", "mean_accepted_length", "acceptance_rate",
                    "per_category"):
            assert key in entry
        assert set(entry["per_category"]) == {"code_writing", "agent_sessions"}
        for cat in entry["per_category"].values():
            assert {"speedup", "tokens_per_second", "mean_accepted_length", "exact_match"} <= set(cat)
    self_draft = results["methods"][f"model:{target.name}:k=3:backend=hf"]
    assert self_draft["acceptance_rate"] == 1.0 and self_draft["mean_accepted_length"] > 2.0
    assert self_draft["accepted_per_pos"][0] > 0
    assert (results["methods"]["none"]["speedup"] == 1.0
            and results["methods"]["none"]["mean_accepted_length"] == 1.0)
    assert results["peers"]["hf"]["mean_accepted_length"] is None
    assert {"cpu", "cores", "torch", "transformers", "python"} <= set(results["machine"])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["methods"].keys() == results["methods"].keys()
    rows = [json.loads(line) for line in (tmp_path / "questions.jsonl").read_text().splitlines()]
    assert [r["question_id"] for r in rows] == [1, 2, 3]
    assert len(rows[1]["runs"]["hf"]) == 2 and rows[1]["runs"]["ngram"][1]["exact_match"] is True
    md = (tmp_path / "results.md").read_text()
    assert "### agent_sessions" in md and "`hf-pld (peer)`" in md
    for png in ("speedup.png", "accept_lengths.png", "k_history.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_lossy_engine_is_reported_as_a_mismatch(target, draft, monkeypatch, tmp_path, capsys):
    def accept_everything(draft_tokens, target_argmax):  # a broken verifier: never rejects
        k = draft_tokens.shape[0]
        return VerifyResult(k, int(target_argmax[k]), k)

    monkeypatch.setattr("specdec.sequence.verify_greedy", accept_everything)
    from specdec.drafters.draft_model import ModelDrafter
    from specdec.engine import Engine

    runners = bench.make_engine_runners(target, ["none"])
    drafter = ModelDrafter(bench.make_engine_runners(draft, ["none"])[0].engine.backend, target.eos_token_ids)
    runners.append(bench.EngineRunner("lossy", Engine(target=target, drafter=drafter, k=4)))
    logged: list[str] = []
    run = run_benchmark(target, QUESTIONS, runners, max_new_tokens=12, progress=False, log=logged.append)
    assert run.mismatches, "a verifier that accepts every draft must break exact matching"
    m = run.mismatches[0]
    assert m["runner"] == "lossy" and m["kind"] == "method" and m["question_id"] in (1, 2, 3)
    assert 0 <= m["position"] < 12 and m["turn"] >= 1
    assert any("MISMATCH" in line and "lossy" in line for line in logged)
    n_turns = sum(len(q.turns) for q in QUESTIONS)
    with pytest.raises(SystemExit) as exc:
        finish(run, tmp_path, {}, plots=False)
    assert exc.value.code == 1
    results = json.loads((tmp_path / "results.json").read_text())
    matched, total = map(int, results["methods"]["lossy"]["exact_match"].split("/"))
    assert total == n_turns and matched < total
    assert results["mismatches"][0]["position"] == m["position"]
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["mismatches"] == len(run.mismatches)
    assert "LOSSLESSNESS FAILURE" in out.err


def test_sampling_skips_exact_match(target):
    runners = (bench.make_engine_runners(target, ["none", "ngram"])
               + make_peers(["hf"], target, target.name, [], {}))
    run = run_benchmark(target, QUESTIONS, runners, max_new_tokens=12, temperature=0.8, progress=False)
    assert run.mismatches == [] and not run.greedy
    results = bench.summarize(run)
    assert results["methods"]["ngram"]["exact_match"] == "n/a (sampling)"
    assert results["peers"]["hf"]["exact_match"] == "n/a (sampling)"
    assert all(t.new_tokens > 0 for turns in run.records["hf"].values() for t in turns)


class _Recorder(bench.Runner):
    kind = "peer"

    def __init__(self, name, answer):
        self.name, self.answer, self.prompts = name, answer, []

    def run(self, prompt_ids, max_new_tokens, temperature, seed):
        self.prompts.append(list(prompt_ids))
        return TurnRecord(list(self.answer))


def test_multi_turn_feeds_each_runners_own_answer(target):
    tok = target.tokenizer
    base = _Recorder("base", tok.encode("brown fox", add_special_tokens=False))
    other = _Recorder("other", tok.encode("lazy dog", add_special_tokens=False))
    q = Question("s1", "agent_sessions", ["Call search.", 'Tool result: {"a": 1}', "Tool result: done"])
    run = run_benchmark(target, [q], [base, other], warmup=0, progress=False, log=lambda m: None)
    assert len(base.prompts) == 3
    turn3 = tok.decode(base.prompts[2])
    assert (turn3.count("brown fox") == 2 and 'Tool result: {"a": 1}' in turn3
            and turn3.endswith("<|assistant|>"))
    assert base.prompts[1][: len(base.prompts[0])] == base.prompts[0]  # the conversation accumulates
    assert "lazy dog" in tok.decode(other.prompts[1]) and "brown fox" not in tok.decode(other.prompts[1])
    assert [m["turn"] for m in run.mismatches] == [1, 2, 3] and run.mismatches[0]["position"] == 0


# ---- speedup arithmetic ------------------------------------------------------------------------


def _synthetic(records: dict[str, list[list[tuple]]], categories) -> BenchRun:
    """records: runner -> questions -> turns of (new tokens, wall seconds[, prefill seconds])."""
    questions = [Question(i, c, ["x"] * len(records["none"][i])) for i, c in enumerate(categories)]
    runners = [SimpleNamespace(name=n, kind="method") for n in records]
    recs = {
        n: {qi: [TurnRecord([7] * turn[0], wall_s=turn[1], prefill_s=turn[2] if len(turn) > 2 else None,
                            steps=turn[0]) for turn in turns]
            for qi, turns in enumerate(qs)}
        for n, qs in records.items()
    }
    return BenchRun(questions, runners, "none", recs, [], greedy=True)


def test_speedup_is_ratio_of_mean_question_speeds():
    run = _synthetic(
        {
            # question tok/s: baseline 10 and 20 (two turns: 30 tokens / 1.5 s); method 40 and 30
            "none": [[(10, 1.0)], [(10, 0.5), (20, 1.0)]],
            "fast": [[(10, 0.25)], [(15, 0.5), (15, 0.5)]],
        },
        ["a", "b"],
    )
    res = bench.summarize(run)
    fast = res["methods"]["fast"]
    assert fast["tokens_per_second"] == pytest.approx(35.0)
    assert fast["speedup"] == pytest.approx(35.0 / 15.0, abs=1e-4)  # not the mean of ratios (2.75)
    assert fast["per_category"]["a"]["speedup"] == pytest.approx(4.0)
    assert fast["per_category"]["b"]["speedup"] == pytest.approx(1.5)
    assert res["methods"]["none"]["speedup"] == 1.0
    assert "| `fast` | 4.00x | 1.50x | **2.33x**" in markdown({**res, "settings": {}})
    assert fast["decode_speedup"] is None  # no prefill times recorded


@pytest.mark.parametrize(
    "base, fast, speedup, decode_speedup, prefill_share",
    [
        # 20 tokens: plain 2.0 s of which 1.0 s prefill; the method decodes 4x faster
        ([(20, 2.0, 1.0)], [(20, 1.25, 1.0)], 1.6, 4.0, 0.8),
        # no prefill: both speedups agree
        ([(20, 2.0, 0.0)], [(20, 0.5, 0.0)], 4.0, 4.0, 0.0),
        # two turns, prefill pooled over the question's turns
        ([(10, 1.0, 0.5), (10, 1.0, 0.5)], [(10, 0.75, 0.5), (10, 0.75, 0.5)], 4 / 3, 2.0, 2 / 3),
    ],
)
def test_decode_only_speedup_leaves_prefill_out(base, fast, speedup, decode_speedup, prefill_share):
    res = bench.summarize(_synthetic({"none": [base], "fast": [fast]}, ["agent"]))
    entry = res["methods"]["fast"]
    assert entry["speedup"] == pytest.approx(speedup, abs=1e-3)
    assert entry["decode_speedup"] == pytest.approx(decode_speedup, abs=1e-3)
    assert entry["prefill_share"] == pytest.approx(prefill_share, abs=1e-3)
    assert entry["per_category"]["agent"]["decode_speedup"] == pytest.approx(decode_speedup, abs=1e-3)
    table = markdown({**res, "settings": {}})
    assert f"| {decode_speedup:.2f}x | {prefill_share:.0%} |" in table


# ---- the CLI -----------------------------------------------------------------------------------


def _cli_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "lines, expect",
    [
        (['{"question_id": 1, "category": "math", "turns": ["2+2?"]}', "{not json"], ":2: malformed JSON"),
        (['{"question_id": 1, "turns": ["hi"]}'], ":1: missing field(s) category"),
        (['{"question_id": 1, "category": "math", "turns": []}'], ":1: turns must be"),
        (['{"question_id": 1, "category": "math", "turns": ["a"]}'] * 2, ":2: duplicate question_id 1"),
    ],
)
def test_cli_bad_data_lines(tmp_path, capsys, lines, expect):
    data = tmp_path / "q.jsonl"
    data.write_text("\n".join(lines) + "\n")
    err = _cli_error(["bench", "--data", str(data), "--methods", "none"], capsys)
    assert str(data) + expect in err


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["--data", "/no/such/file.jsonl"], "question file not found: /no/such/file.jsonl"),
        (["--categories", "math,poetry"], "unknown category 'poetry'"),
        (["--methods", "none,warp"], "unknown method 'warp'"),
        (["--peers", "hf,vllm"], "unknown peer 'vllm'"),
        (["--peers", "hf-assisted"], "needs a model:PATH method"),
        (["--backend", "tpu"], "unknown backend 'tpu'"),
        (["--limit", "0"], "must be >= 1"),
    ],
)
def test_cli_bad_arguments(capsys, extra, expect):
    argv = ["bench", "--methods", "none,ngram", *extra]
    if "--methods" in extra:
        argv = ["bench", *extra]
    assert expect in _cli_error(argv, capsys)


@pytest.mark.slow
def test_cli_end_to_end_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "bench"
    main([
        "bench", "--categories", "tool_calls,agent_sessions", "--limit", "1", "--max-new-tokens", "12",
        "--methods", "none,ngram", "--peers", "llamacpp", "--out", str(out), "--no-plots",
        "--warmup", "0",  # the warm-up is tested on tiny models; here it would double the time
    ])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = json.loads((out / "results.json").read_text())
    turns = results["settings"]["turns"]
    assert summary["methods"]["ngram"]["exact_match"] == f"{turns}/{turns}"
    # the hf peer's exactness: test_run_matches_baseline_and_writes_every_output (tiny models) and
    # test_real_model's native-against-transformers checks on this model
    if llamacpp_available():  # the optional extra runs the GGUF itself; its tokens may differ
        assert results["peers"]["llamacpp"]["tokens_per_second"] > 0
    else:
        assert "llamacpp" not in results["peers"] and "not installed" in results["notes"][0]
