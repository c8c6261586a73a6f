"""`specdec bench`: Spec-Bench-style measurement of methods and peers on one loaded target.

Measurement follows Spec-Bench (evaluation/speed.py):
- every runner first warms up on prompts outside the set (a prompt from the set would teach
  drafters that learn across requests the answer they are about to be timed on);
- each turn's generate call is timed on the wall clock, prefill included;
- a question's speed is sum(new tokens) / sum(wall time) over its turns;
- speedup = mean over questions of the runner's tok/s / the same mean for the baseline;
- τ (mean accepted length) is pooled over all decoding steps.

Tool sessions (category `tool_sessions`, tool_sessions.py) run as agents talk to the API:
declared tools, replies under a grammar, the model's own calls answered by scripted tool
results; their report adds the valid-call rate and the share of grammar-forced tokens.

Runners take turns question by question (each question: every method and every peer, in an
order that rotates from one question to the next), so machine drift hits them all alike.
A multi-turn question feeds turn n+1 after the runner's own answer to turn n. Under greedy
decoding every runner's token ids are compared with the baseline's, turn by turn: that is the
losslessness check, and a mismatch is always reported.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.tool_sessions import ToolSession, call_metrics, parse_session, run_session, warm_up_request
from specdec.config import EngineConfig, split_k
from specdec.drafters import DrafterSpec, available
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.models import resolve
from specdec.prompts import encode

DEFAULT_DATA = Path(__file__).parent / "data" / "bench.jsonl"
# Warm-up prompts, outside the set: a short one, and a long one so that prefill shapes of the
# size of the long-document categories have run once before anything is timed.
WARMUP_PROMPTS = (
    "Name three things a cache is good for, one line each.",
    " ".join(f"Item {i}: the value is {i * 7 % 13}." for i in range(60))
    + " Which item has the largest value?",
)


# ---- questions --------------------------------------------------------------------------


@dataclass
class Question:
    question_id: int | str
    category: str
    turns: list  # the user messages; a tool session's turn objects
    reference: object = None
    session: ToolSession | None = None  # a tool session (tool_sessions.py)


def load_questions(
    path: str | Path | None = None, categories: Sequence[str] | None = None, limit: int | None = None
) -> list[Question]:
    """Read Spec-Bench question JSONL; keep `categories` (all if None), at most `limit` each."""
    path = Path(path) if path is not None else DEFAULT_DATA
    if not path.is_file():
        raise SpecdecError(f"question file not found: {path}", "data")
    questions: list[Question] = []
    seen: set = set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{where}: malformed JSON ({e.msg} at column {e.colno})", "data") from None
        if not isinstance(obj, dict):
            raise SpecdecError(f"{where}: expected a JSON object", "data")
        missing = [k for k in ("question_id", "category", "turns") if k not in obj]
        if missing:
            raise SpecdecError(f"{where}: missing field(s) {', '.join(missing)}", "data")
        qid, category, turns = obj["question_id"], obj["category"], obj["turns"]
        session = parse_session(obj, where) if "tools" in obj else None
        if not isinstance(qid, int | str) or isinstance(qid, bool):
            raise SpecdecError(f"{where}: question_id must be an integer or a string", "data")
        if qid in seen:
            raise SpecdecError(f"{where}: duplicate question_id {qid!r}", "data")
        if not isinstance(category, str) or not category:
            raise SpecdecError(f"{where}: category must be a non-empty string", "data")
        if session is None and (not isinstance(turns, list) or not turns
                                or not all(isinstance(t, str) and t.strip() for t in turns)):
            raise SpecdecError(f"{where}: turns must be a non-empty list of non-empty strings", "data")
        seen.add(qid)
        questions.append(Question(qid, category, turns, obj.get("reference"), session))
    if not questions:
        raise SpecdecError(f"{path}: no questions", "data")
    if categories:
        present = sorted({q.category for q in questions})
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise SpecdecError(
                f"unknown category {unknown[0]!r} in {path.name}; choose from: {', '.join(present)}",
                "categories",
            )
        questions = [q for q in questions if q.category in set(categories)]
    if limit is not None:
        counts: dict[str, int] = {}
        kept = []
        for q in questions:
            counts[q.category] = counts.get(q.category, 0) + 1
            if counts[q.category] <= limit:
                kept.append(q)
        questions = kept
    return questions


# ---- methods ------------------------------------------------------------------------------


def parse_methods(text: str | Sequence[str], target_name: str | None = None) -> list[str]:
    """Split and validate method strings before any model is loaded; the baseline `none` is
    put first (added when missing)."""
    items = [m.strip() for m in text.split(",")] if isinstance(text, str) else [m.strip() for m in text]
    if not items or any(not m for m in items):
        raise SpecdecError(f"--methods has an empty entry: {text!r}", "methods")
    if len(set(items)) != len(items):
        dup = next(m for m in items if items.count(m) > 1)
        raise SpecdecError(f"method {dup!r} is listed twice", "methods")
    names = available()
    for method in items:
        spec = DrafterSpec.parse(method)
        if spec.name not in names:
            raise SpecdecError(f"unknown method {method!r}; drafters: {', '.join(names)}", "methods")
        split_k(method)  # checks a `k=` in it
        if spec.name == "model" and spec.arg and spec.arg != target_name:
            resolve(spec.arg)  # a wrong path fails now, not after the target has loaded
    baseline = next((m for m in items if DrafterSpec.parse(m).name == "none"), None)
    if baseline is None:
        return ["none", *items]
    return [baseline, *(m for m in items if m != baseline)]


# ---- runs ---------------------------------------------------------------------------------


@dataclass
class TurnRecord:
    token_ids: list[int]
    wall_s: float = 0.0
    prefill_s: float | None = None  # of wall_s, the time to read the prompt; None for peers
    steps: int | None = None  # target forwards while decoding; None for peers
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    k_history: list[int] = field(default_factory=list)
    exact_match: bool | None = None  # vs the baseline's tokens; None when not compared
    first_diff: int | None = None
    text: str = ""
    forced: int = 0  # tokens a grammar forced (tool sessions)
    calls: list[dict] | None = None  # a tool-session reply's parsed calls ({"name", "arguments"})
    valid_call: bool | None = None  # on turns that must call: whether every call is valid

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


class Runner:
    """Generates one turn from prompt token ids. `kind` is "method" or "peer"."""

    name: str
    kind: str
    exact = True  # False for a runner on other weights (quantized llama.cpp): differences are expected

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            constraint=None) -> TurnRecord:
        """`constraint`: a tool session's grammar.Constraint, or None; runners that cannot
        constrain their output (peers) ignore it."""
        raise NotImplementedError


class EngineRunner(Runner):
    kind = "method"

    def __init__(self, name: str, engine):
        self.name, self.engine = name, engine

    def run(self, prompt_ids, max_new_tokens, temperature, seed, constraint=None) -> TurnRecord:
        result = self.engine.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                      seed=seed, response_format=constraint)
        s = result.stats
        return TurnRecord(
            list(result.token_ids), prefill_s=s.prefill_s, steps=s.num_steps, drafted=s.num_draft_tokens,
            accepted=s.num_accepted_tokens, accepted_per_pos=list(s.accepted_per_pos),
            drafted_per_pos=list(s.drafted_per_pos), accept_lengths=list(s.accept_lengths),
            k_history=list(s.k_history), forced=s.num_forced_tokens,
        )


def make_engine_runners(target, methods: Sequence[str],
                        config: EngineConfig | None = None) -> list[EngineRunner]:
    """One Engine per method, all sharing the loaded target's weights: `config` with the
    method as its drafter (a `k=` in the method wins). `none` is plain decoding: k = 0, and a
    grammar's forced tokens scored one per forward too, as every other method drafts them."""
    runners = []
    for method in methods:
        plain = DrafterSpec.parse(method).name == "none"
        engine = Engine(target, method, config=config, k=0 if plain else None, draft_forced=not plain)
        runners.append(EngineRunner(method, engine))
    return runners


@dataclass
class BenchRun:
    questions: list[Question]
    runners: list[Runner]
    baseline: str
    records: dict[str, dict[int, list[TurnRecord]]]  # runner -> question index -> turns
    mismatches: list[dict]
    greedy: bool
    notes: list[str] = field(default_factory=list)
    grammar: bool = True  # tool sessions decode under their grammars (False: --no-grammar)


def run_benchmark(
    target,
    questions: Sequence[Question],
    runners: Sequence[Runner],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    warmup: int = 1,
    seed: int = 0,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    grammar: bool = True,
) -> BenchRun:
    """Run every runner on every question, interleaved; runners[0] is the baseline.
    `grammar=False` decodes tool sessions without their grammars."""
    from tqdm.auto import tqdm

    greedy = temperature == 0.0
    baseline = runners[0].name
    records: dict[str, dict[int, list[TurnRecord]]] = {r.name: {} for r in runners}
    mismatches: list[dict] = []
    bar = tqdm(total=len(questions) * len(runners), desc="bench", unit="run", file=sys.stderr,
               disable=not progress)
    say = log or (lambda msg: bar.write(msg, file=sys.stderr))

    bar.set_description("warm-up")
    session = next((q.session for q in questions if q.session is not None), None) if grammar else None
    _warm_up(target, runners, warmup, min(16, max_new_tokens), temperature, seed, session, max_new_tokens)
    bar.set_description("bench")
    for qi, question in enumerate(questions):
        # Rotate the order each question, so no runner always follows the same one (a runner
        # can leave spinning threads or a cold cache behind for the next).
        shift = qi % len(runners)
        for runner in [*runners[shift:], *runners[:shift]]:
            bar.set_postfix_str(f"{question.question_id} {runner.name}", refresh=False)
            turn_seeds = [seed * 1_000_003 + qi * 64 + ti for ti in range(len(question.turns))]
            records[runner.name][qi] = _run_turns(target, runner, question, max_new_tokens, temperature,
                                                  turn_seeds, grammar)
            bar.update(1)
        if greedy:
            for runner in runners[1:]:
                base, turns = records[baseline][qi], records[runner.name][qi]
                mismatches += _compare(question, runner, base, turns, target.tokenizer, say)
    bar.close()
    return BenchRun(list(questions), list(runners), baseline, records, mismatches, greedy, grammar=grammar)


def _warm_up(target, runners: Sequence[Runner], rounds: int, max_new_tokens: int, temperature: float,
             seed: int, session: ToolSession | None = None, constrained_tokens: int = 128) -> None:
    """Warm-up prompts outside the set; with tool sessions, also one constrained reply on a
    session's tools (the grammar's tokenizer tables are built once, not in a timed turn), with
    the run's own budget (`constrained_tokens`), which a complete call must fit."""
    tokenizer = target.tokenizer
    warm = [(encode(tokenizer, WARMUP_PROMPTS[0], max_length=target.max_length), None)]
    long_ids = tokenizer.encode(WARMUP_PROMPTS[1], add_special_tokens=False)
    if len(long_ids) + 64 < target.max_length:  # tiny test models have short windows
        warm.append((encode(tokenizer, WARMUP_PROMPTS[1], max_length=target.max_length), None))
    if session is not None:
        warm.append(warm_up_request(target, session, WARMUP_PROMPTS[0]))
    for runner in runners:
        for _ in range(rounds):
            for ids, constraint in warm:
                if constraint is None:
                    runner.run(ids, max_new_tokens, temperature, seed)
                else:
                    runner.run(ids, constrained_tokens, temperature, seed, constraint=constraint)


def _run_turns(target, runner: Runner, question: Question, max_new_tokens: int, temperature: float,
               seeds: list[int], grammar: bool = True) -> list[TurnRecord]:
    """One runner on one question: turn n+1 follows the runner's own answer to turn n."""
    if question.session is not None:
        try:
            return run_session(target, runner, question.session, max_new_tokens, temperature, seeds, grammar)
        except SpecdecError as e:
            raise SpecdecError(f"question {question.question_id!r} {e.message}", "data") from e
    tokenizer = target.tokenizer
    messages: list[dict] = []
    turns = []
    for ti, (turn, seed) in enumerate(zip(question.turns, seeds, strict=True)):
        messages.append({"role": "user", "content": turn})
        try:
            prompt_ids = encode(tokenizer, messages, max_length=target.max_length)
        except SpecdecError as e:
            raise SpecdecError(f"question {question.question_id!r} turn {ti + 1}: {e.message}", "data") from e
        t0 = time.perf_counter()
        record = runner.run(prompt_ids, max_new_tokens, temperature, seed)
        record.wall_s = time.perf_counter() - t0
        record.text = tokenizer.decode(record.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": record.text})
        turns.append(record)
    return turns


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the sequences differ (incl. one ending early), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _compare(question, runner, base_turns, turns, tokenizer, say) -> list[dict]:
    found = []
    for ti, (base, rec) in enumerate(zip(base_turns, turns, strict=True)):
        pos = first_difference(base.token_ids, rec.token_ids)
        rec.exact_match, rec.first_diff = pos is None, pos
        if pos is None:
            continue

        def tok(ids, pos=pos):
            return repr(tokenizer.decode([ids[pos]])) if pos < len(ids) else "<end>"

        item = {
            "runner": runner.name, "kind": runner.kind, "question_id": question.question_id,
            "category": question.category, "turn": ti + 1, "position": pos,
            "baseline_token": base.token_ids[pos] if pos < len(base.token_ids) else None,
            "runner_token": rec.token_ids[pos] if pos < len(rec.token_ids) else None,
            "same_weights": runner.exact,
        }
        found.append(item)
        say(
            f"specdec bench: {'MISMATCH' if runner.exact else 'differs (other weights)'} {runner.kind} "
            f"{runner.name!r} question {question.question_id!r} turn {ti + 1}: first difference at token "
            f"{pos} (baseline {tok(base.token_ids)}, {runner.name} {tok(rec.token_ids)})"
        )
    return found


# ---- metrics ------------------------------------------------------------------------------


def question_tps(turns: Sequence[TurnRecord]) -> float:
    """Spec-Bench's per-question speed: sum of new tokens / sum of wall time over its turns."""
    wall = sum(t.wall_s for t in turns)
    return sum(t.new_tokens for t in turns) / wall if wall > 0 else 0.0


def question_decode_tps(turns: Sequence[TurnRecord]) -> float | None:
    """The same speed with the prompts' prefill left out: what speculation can change.
    None when a turn's prefill time is unknown (peers)."""
    if any(t.prefill_s is None for t in turns):
        return None
    wall = sum(t.wall_s - t.prefill_s for t in turns)
    return sum(t.new_tokens for t in turns) / wall if wall > 0 else 0.0


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _add_lists(total: list[int], part: Sequence[int]) -> None:
    total.extend([0] * (len(part) - len(total)))
    for i, v in enumerate(part):
        total[i] += v


def aggregate(
    run_turns: dict[int, list[TurnRecord]], base_turns: dict[int, list[TurnRecord]], greedy: bool,
    is_method: bool
) -> dict:
    """Speedup, tok/s, τ, acceptance and exact matches over the given questions."""
    qis = sorted(run_turns)
    tps = _mean([question_tps(run_turns[q]) for q in qis])
    base_tps = _mean([question_tps(base_turns[q]) for q in qis])
    turns = [t for q in qis for t in run_turns[q]]
    out: dict = {
        "speedup": round(tps / base_tps, 4) if base_tps > 0 else None,
        "tokens_per_second": round(tps, 3),
    }
    decode = [question_decode_tps(run_turns[q]) for q in qis]
    base_decode = [question_decode_tps(base_turns[q]) for q in qis]
    if None in decode or None in base_decode or _mean(base_decode) <= 0:
        out["decode_speedup"] = out["prefill_share"] = None
    else:
        # Multi-turn prompts (agents resending their conversation) make prefill a large,
        # speculation-proof part of the wall time; report it, and the speedup without it.
        out["decode_speedup"] = round(_mean(decode) / _mean(base_decode), 4)
        wall = sum(t.wall_s for t in turns)
        out["prefill_share"] = round(sum(t.prefill_s for t in turns) / wall, 4) if wall > 0 else None
    if is_method:
        steps = sum(t.steps or 0 for t in turns)
        drafted = sum(t.drafted for t in turns)
        out["mean_accepted_length"] = round(sum(t.new_tokens for t in turns) / steps, 4) if steps else None
        out["acceptance_rate"] = round(sum(t.accepted for t in turns) / drafted, 4) if drafted else None
    else:  # peers are black boxes: their steps are not observable
        out["mean_accepted_length"] = out["acceptance_rate"] = None
    out.update(call_metrics(turns, is_method))
    if not greedy:
        out["exact_match"] = "n/a (sampling)"
    else:
        compared = [t for t in turns if t.exact_match is not None]
        matched = sum(1 for t in compared if t.exact_match)
        out["exact_match"] = f"{matched}/{len(compared)}" if compared else f"{len(turns)}/{len(turns)}"
    return out


def summarize(run: BenchRun) -> dict:
    """results.json's "baseline", "methods", "peers" and "mismatches" entries."""
    base = run.records[run.baseline]
    cats = list(dict.fromkeys(q.category for q in run.questions))
    results: dict = {"baseline": run.baseline, "methods": {}, "peers": {}}
    for runner in run.runners:
        recs = run.records[runner.name]
        is_method = runner.kind == "method"
        entry = aggregate(recs, base, run.greedy, is_method)
        turns = [t for q in sorted(recs) for t in recs[q]]
        accepted_per_pos: list[int] = []
        drafted_per_pos: list[int] = []
        for t in turns:
            _add_lists(accepted_per_pos, t.accepted_per_pos)
            _add_lists(drafted_per_pos, t.drafted_per_pos)
        entry["accepted_per_pos"] = accepted_per_pos if is_method else None
        entry["drafted_per_pos"] = drafted_per_pos if is_method else None
        entry["generated_tokens"] = sum(t.new_tokens for t in turns)
        entry["wall_time_s"] = round(sum(t.wall_s for t in turns), 3)
        entry["per_category"] = {}
        for cat in cats:
            qis = [i for i, q in enumerate(run.questions) if q.category == cat]
            sub = aggregate({i: recs[i] for i in qis}, base, run.greedy, is_method)
            sub.pop("acceptance_rate")
            entry["per_category"][cat] = sub
        results["methods" if is_method else "peers"][runner.name] = entry
    results["mismatches"] = list(run.mismatches)
    results["notes"] = list(run.notes)
    return results


def question_records(run: BenchRun) -> list[dict]:
    """One auditable record per question: prompts, and every runner's turns with their timings."""
    rows = []
    for qi, q in enumerate(run.questions):
        runs = {}
        for runner in run.runners:
            runs[runner.name] = [
                {
                    "new_tokens": t.new_tokens, "wall_time": round(t.wall_s, 5),
                    "prefill_time": None if t.prefill_s is None else round(t.prefill_s, 5), "steps": t.steps,
                    "exact_match": t.exact_match, "first_diff": t.first_diff,
                    "accept_lengths": t.accept_lengths, "k_history": t.k_history,
                    "text": t.text, "token_ids": t.token_ids,
                    **({"forced": t.forced, "tool_calls": t.calls, "valid_call": t.valid_call}
                       if q.session else {}),
                }
                for t in run.records[runner.name][qi]
            ]
        rows.append({"question_id": q.question_id, "category": q.category, "turns": q.turns, "runs": runs})
    return rows
