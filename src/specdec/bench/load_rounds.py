"""Rounds of the load benchmark: which configuration runs when, and what the rounds add up to.

A configuration is an engine in one mode (a `Target`) at one concurrency. `schedule` runs every
configuration once per round, the engines in turns within each round, so that a shared
machine's drifts fall on all of them; `summarize` folds the rounds of each configuration into
one row: medians of the rates and latencies, sums of the counts (requests, errors, lost replies).
`plot` draws the rows. Nothing here talks to a server.

Every configuration gets turns that no server has seen (`fresh_turns`): the sessions' openings
are the same everywhere, and warmed before round 1, but each (round, concurrency) tags the
first message of every session's first turn with its own reference, so nothing after it can
come from a prefix cache that an earlier configuration filled. Each engine in each mode has a
server of its own, so the targets of one configuration get the same prompts and their greedy
replies can be compared.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from specdec.bench import server_time

# row fields that are medians over rounds; every other number in a run is summed or kept as it is
MEDIAN_FIELDS = ("wall_s", "tok_per_s", "latency_p50_s", "latency_p95_s", "latency_p99_s", "ttft_p50_s",
                 "ttft_p99_s", "tpot_mean_s", "acceptance_rate", "tau", *server_time.FIELDS)
SUMMED_FIELDS = ("requests", "tokens", "prefilled_tokens", "errors", "lost")


@dataclass(frozen=True)
class Target:
    """One engine in one mode, as the benchmark sends to it."""

    engine: str  # "specdec" or "llama-server"
    mode: str  # "on" (speculation) or "off"
    label: str  # the line in tables and plots, e.g. "llama-server ngram-mod"
    url: str
    extra: dict = field(default_factory=dict)  # body fields only this engine takes
    headers: dict = field(default_factory=dict)

    @property
    def speculation(self) -> bool:
        return self.mode == "on"


def variant(round_: int, concurrency: int, levels: list[int]) -> int:
    """The turns' tag of one configuration: the same for every target of a (round,
    concurrency), different for every other; 0 (no tag) is the warm-up's."""
    return (round_ - 1) * len(levels) + levels.index(concurrency) + 1


def fresh_turns(sessions: list, tag: int) -> list:
    """`sessions` whose first turn's first message carries reference `tag` (0: unchanged)."""
    if tag == 0:
        return sessions
    out = []
    for session in sessions:
        first, *rest = session.turns
        if first:
            head = first[0]
            first = [{**head, "content": f"(ref {tag:03d}) {head['content']}"}, *first[1:]]
        out.append(replace(session, turns=[first, *rest]))
    return out


def schedule(targets: list[Target], levels: list[int], rounds: int) -> list[tuple[int, Target, int]]:
    """(round, target, concurrency) in running order: round by round, and within a round every
    target in turn, each at every concurrency level."""
    return [(r, t, c) for r in range(1, rounds + 1) for t in targets for c in levels]


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (target label, concurrency), in first-run order, from runs that each carry
    `label`, `engine`, `speculation`, `concurrency`, `round`, `texts` and the measured fields."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["label"], run["concurrency"]), []).append(run)
    rows = []
    for group in groups.values():
        first = group[0]
        row = {key: first[key] for key in ("engine", "label", "concurrency", "speculation")}
        row["rounds"] = len(group)
        for key in SUMMED_FIELDS:
            row[key] = sum(run.get(key, 0) for run in group)
        for key in MEDIAN_FIELDS:
            value = median([run.get(key) for run in group])
            row[key] = round(value, 5) if value is not None else None
        row["prompt_tokens_max"] = max(run.get("prompt_tokens_max", 0) for run in group)
        row["first_error"] = next((run["first_error"] for run in group if run.get("first_error")), None)
        row["tok_per_s_rounds"] = [run["tok_per_s"] for run in group]
        row["latency_p95_s_rounds"] = [run["latency_p95_s"] for run in group]
        row["runs_texts"] = [run["texts"] for run in group]
        rows.append(row)
    return rows


def mark_exact_matches(rows: list[dict]) -> None:
    """Greedy replies are the same whatever the mode, within one engine: set each row's
    `exact_match` to how many of its replies equal those of its engine's first row at the same
    concurrency, round by round (the rows of one round and concurrency got the same prompts).
    Replies another row never got count as different."""
    reference: dict[tuple[str, int], list[dict[str, str]]] = {}
    for row in rows:
        refs = reference.setdefault((row["engine"], row["concurrency"]), row["runs_texts"])
        pairs = list(zip(row["runs_texts"], refs, strict=False))
        same = sum(texts.get(key) == text for texts, ref in pairs for key, text in ref.items())
        row["exact_match"] = f"{same}/{sum(len(ref) for _, ref in pairs)}"


def first_turn_agreement(rows: list[dict], reference_engine: str = "specdec") -> dict[str, str]:
    """label -> how many first-turn replies (keys "i.0") equal the reference engine's, for the
    other engines' rows at their lowest concurrency: with raw prompts their first prompts are
    the same text, so this is how often two engines pick the same greedy tokens."""
    ref_rows = [r for r in rows if r["engine"] == reference_engine]
    if not ref_rows:
        return {}
    ref = {k: v for k, v in ref_rows[0]["runs_texts"][0].items() if k.endswith(".0")}
    out = {}
    for row in rows:
        if row["engine"] != reference_engine and row["label"] not in out:
            texts = row["runs_texts"][0]
            out[row["label"]] = f"{sum(texts.get(k) == v for k, v in ref.items())}/{len(ref)}"
    return out


def plot(rows: list[dict], path: str) -> None:
    """Aggregate tok/s and p95 latency against concurrency, one line per target, into `path`."""
    import matplotlib  # the bench extra; only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, latency_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["concurrency"])
        levels = [r["concurrency"] for r in mine]
        rate_ax.plot(levels, [r["tok_per_s"] for r in mine], marker="o", label=label)
        latency_ax.plot(levels, [r["latency_p95_s"] for r in mine], marker="o", label=label)
    rounds = max((r["rounds"] for r in rows), default=1)
    for ax, title, unit in ((rate_ax, "aggregate completion throughput", "tok/s"),
                            (latency_ax, "request latency p95", "s")):
        ax.set_title(f"{title} (median of {rounds} round{'s' if rounds > 1 else ''})")
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(unit)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.grid(alpha=0.3)
    rate_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
