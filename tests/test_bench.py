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
from specdec.bench.tool_sessions import call_metrics, exchange, reply_is_valid
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


# ---- tool sessions -----------------------------------------------------------------------------

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 6}}, "required": ["query"],
    "additionalProperties": False}}}
UNIT = {"type": "function", "function": {"name": "unit", "parameters": {
    "type": "object",
    "properties": {"to": {"enum": ["c", "f"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["to"], "additionalProperties": False}}}
SESSION_TOOLS = [SEARCH, UNIT]
NAMED_UNIT = {"type": "function", "function": {"name": "unit"}}
SESSION = {"question_id": "s1", "category": "tool_sessions", "system": "You act through tools.",
           "tools": SESSION_TOOLS,
           "turns": [{"user": "Search the weather.", "tool_choice": "required", "result": {"temp": 21}},
                     {"tool_choice": NAMED_UNIT, "result": "21 C is 70 F"},
                     {"user": "Thanks.", "tool_choice": "auto"}]}
CALL_TEXT = '<tool_call>\n{"name": "search", "arguments": {"query": "sun"}}\n</tool_call>'


@pytest.fixture(scope="module")
def long_target():
    # a tool list takes hundreds of the tiny vocabulary's tokens
    return tiny_llama(seed=0, max_positions=2048)


def _sessions(tmp_path, *records) -> list[Question]:
    data = tmp_path / "sessions.jsonl"
    data.write_text("".join(json.dumps({**SESSION, **r}) + "\n" for r in records))
    return load_questions(data)


class _SessionRecorder(_Recorder):
    def __init__(self, name, answer):
        super().__init__(name, answer)
        self.constraints = []

    def run(self, prompt_ids, max_new_tokens, temperature, seed, constraint=None):
        self.constraints.append(constraint)
        return super().run(prompt_ids, max_new_tokens, temperature, seed)


@pytest.mark.parametrize("grammar", [True, False])
def test_tool_session_feeds_results_back_as_tool_messages(long_target, tmp_path, grammar):
    tok = long_target.tokenizer
    runner = _SessionRecorder("base", tok.encode(CALL_TEXT, add_special_tokens=False))
    run = run_benchmark(long_target, _sessions(tmp_path, {}), [runner], warmup=0, progress=False,
                        grammar=grammar)
    turn2, turn3 = (tok.decode(ids) for ids in runner.prompts[1:])
    assert turn2.count('<tool_call>\n{"name": "search", "arguments": {"query": "sun"}}\n</tool_call>') == 1
    assert '<|tool|><tool_response>\n{"name": "search", "content": {"temp": 21}}\n</tool_response>' in turn2
    assert '"content": "21 C is 70 F"' in turn3 and turn3.endswith("<|user|>Thanks.</s><|assistant|>")
    assert runner.prompts[1][: len(runner.prompts[0])] == runner.prompts[0]  # the conversation accumulates
    # auto too: a call, once opened, is forced
    assert [c is not None for c in runner.constraints] == [grammar] * 3
    turns = run.records["base"][0]
    assert [t.valid_call for t in turns] == [True, False, None]  # turn 2 had to call `unit`
    assert turns[0].calls == [{"name": "search", "arguments": '{"query": "sun"}'}]
    assert call_metrics(turns, is_method=False) == {"valid_calls": "1/2", "valid_call_rate": 0.5,
                                                    "forced_share": None}


@pytest.mark.parametrize(
    "calls, result, expected",
    [
        ([{"name": "search", "arguments": "{}"}], {"a": 1},
         [{"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_2_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "call_2_1", "content": '{"a": 1}'}]),
        ([], "done", [{"role": "assistant", "content": "hello"},
                      {"role": "tool", "tool_call_id": "call_2_0", "content": "done"}]),
        ([{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": "{}"}], "ok",
         [{"role": "assistant", "content": "hello", "tool_calls": [
             {"id": "call_2_1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
             {"id": "call_2_2", "type": "function", "function": {"name": "b", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "call_2_1", "content": "ok"},
          {"role": "tool", "tool_call_id": "call_2_2", "content": "ok"}]),
        ([{"name": "a", "arguments": "{}"}], None,
         [{"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_2_1", "type": "function", "function": {"name": "a", "arguments": "{}"}}]}]),
    ],
)
def test_exchange_answers_each_call(calls, result, expected):
    content = "" if calls and expected[0]["content"] is None else "hello"
    assert exchange(content, calls, result, 1) == expected


def _call(name, **args):
    return {"name": name, "arguments": json.dumps(args)}


@pytest.mark.parametrize(
    "calls, choice, valid",
    [
        ([_call("search", query="sun")], "required", True),
        ([_call("unit", to="f", n=3)], NAMED_UNIT, True),
        ([_call("search", query="sun"), _call("unit", to="c")], "required", True),
        ([], "required", False),  # no call at all
        ([_call("search", query="sun")], NAMED_UNIT, False),  # not the named tool
        ([_call("lookup", query="sun")], "required", False),  # not a declared tool
        ([{"name": "search", "arguments": '{"query": "sun"'}], "required", False),  # cut short: not JSON
        ([{"name": "search", "arguments": '["sun"]'}], "required", False),  # not an object
        ([_call("search", query="sunshine")], "required", False),  # maxLength
        ([_call("search")], "required", False),  # a required argument is missing
        ([_call("search", query="sun", page=2)], "required", False),  # additionalProperties
        ([_call("unit", to="k")], "required", False),  # enum
        ([_call("unit", to="c", n="3")], "required", False),  # type
        ([_call("search", query="sun"), _call("unit", to="x")], "required", False),  # one bad call of two
    ],
)
def test_valid_calls_parse_and_follow_their_schema(calls, choice, valid):
    assert reply_is_valid(calls, SESSION_TOOLS, choice) is valid


def test_call_metrics_pool_turns():
    turns = [TurnRecord([1] * 10, forced=4, valid_call=True),
             TurnRecord([1] * 10, forced=1, valid_call=False),
             TurnRecord([1] * 20, forced=0, valid_call=None),
             TurnRecord([1] * 10, forced=5, valid_call=True)]
    assert call_metrics(turns) == {"valid_calls": "2/3", "valid_call_rate": 0.6667, "forced_share": 0.2}
    assert call_metrics(turns[2:3]) == {"valid_calls": None, "valid_call_rate": None, "forced_share": 0.0}


def test_tool_sessions_are_exact_under_speculation_with_and_without_grammar(long_target, tmp_path):
    questions = _sessions(tmp_path, {}, {"question_id": "s2", "system": None, "turns": [
        {"user": "Convert it.", "tool_choice": NAMED_UNIT, "result": {"f": 70}},
        {"user": "Again.", "tool_choice": NAMED_UNIT, "result": {"f": 70}},
        {"user": "Search it.", "tool_choice": "required"}]})
    methods = ["none", "ngram:min=1", f"model:{long_target.name}:k=3:backend=hf"]  # on the target's backend
    for grammar in (True, False):
        runners = bench.make_engine_runners(long_target, methods)
        run = run_benchmark(long_target, questions, runners, max_new_tokens=48, progress=False,
                            log=lambda m: None, grammar=grammar)
        assert run.mismatches == []
        results = bench.summarize(run)
        entries = results["methods"]
        assert (len({e["valid_calls"] for e in entries.values()}) == 1
                and entries["none"]["valid_calls"].endswith("/5"))
        plain, self_draft = entries["none"], entries[methods[2]]
        # plain: one token a forward
        assert plain["forced_share"] == 0.0 and plain["mean_accepted_length"] == 1.0
        assert self_draft["acceptance_rate"] > 0.5 and self_draft["mean_accepted_length"] > 2.0
        if grammar:  # the unconstrained self-draft loses the tokens the grammar cuts; forced ones are free
            assert entries["none"]["valid_calls"] == "5/5"  # the grammar forces valid calls
            assert self_draft["forced_share"] > 0.2 and entries["ngram:min=1"]["forced_share"] > 0.2
            assert self_draft["per_category"]["tool_sessions"]["valid_calls"] == "5/5"
        else:
            assert (all(e["forced_share"] == 0.0 for e in entries.values())
                    and self_draft["acceptance_rate"] == 1.0)
    table = markdown({**results, "settings": {"grammar": False}})
    assert "without their grammars" in table and "| Valid calls | Forced |" in table


@pytest.mark.parametrize(
    "change, expect",
    [
        ({"tools": {"name": "search"}}, "tools: expected a list of tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"turns": ["hi"]}, "turns must be a non-empty list of objects"),
        ({"turns": [{"user": "hi", "tool_choice": "required", "reply": "x"}]}, "unknown key 'reply'"),
        ({"turns": [{"tool_choice": "required"}]}, "turns[0]: user must be a non-empty string"),
        ({"turns": [{"user": "hi", "tool_choice": "sometimes"}]},
         "turns[0]: tool_choice: must be none, auto"),
        ({"turns": [{"user": "hi", "tool_choice": {"type": "function", "function": {"name": "x"}}}]},
         "no tool is named 'x'"),
    ],
)
def test_cli_bad_tool_sessions(tmp_path, capsys, change, expect):
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({**SESSION, **change}) + "\n")
    err = _cli_error(["bench", "--data", str(data), "--methods", "none"], capsys)
    assert f"{data}:1: " in err and expect in err


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
