"""Prometheus metrics for the server: vLLM's names under the prefix `specdec:`, every series
labelled `model_name` (the served model name), as vLLM labels its `vllm:` series.

Speculative counters (exposed with the `_total` suffix), as in vLLM's spec_decode metrics,
counted after every scheduler step (a long request shows up while it runs, not when it ends):
- spec_decode_num_drafts: steps that verified a non-empty draft;
- spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens;
- spec_decode_num_accepted_tokens_per_pos{position}: drafts whose token at `position` was kept;
- spec_decode_num_forced_tokens (ours): tokens a grammar forced (structured output, tool
  calls). They are scored and always kept, but are not the drafter's: they stay out of the
  draft and accepted counts, so the acceptance rate measures the drafter alone.
Acceptance rate = rate(accepted_tokens) / rate(draft_tokens); mean acceptance length
= 1 + accepted_tokens / drafts (bonus token included).

Latency histograms: e2e_request_latency_seconds, time_to_first_token_seconds,
inter_token_latency_seconds (one sample per step that gave a request new tokens: the time
since its previous tokens, so a step that emits several speculated tokens counts once, as a
streamed client sees it), request_queue_time_seconds (arrival until the scheduler admitted
the request). Gauges: num_requests_running, num_requests_waiting, kv_cache_usage_perc (the
fraction of KV-cache slots held by running requests). Counters: request_success{finished_reason},
num_requests_rejected{reason} (refused before running: queue full, shutting down),
num_requests_aborted{reason} (ended early: client_disconnect, timeout, error, shutdown; a request
is counted once, as a success or an abort, whichever its worker or its handler claims first),
num_requests_closed_by_budget (ours: structured replies that the token budget closed, complete
and valid, with finished_reason stop; see docs/structured-budget.md).

Where the model worker's time goes (ours), so that a load test can tell which resource is
saturated: model_busy_seconds{phase} (phase "prefill": prompt chunks; "decode": drafting,
scoring and verifying), kv_cache_read_bytes (the cached keys and values that decode steps'
scored rows read) and decode_attention_seconds (what the cost model prices those reads at,
`ScoreCosts.t_key`: an estimate of decode's attention time). batch_size counts decode steps
and batch_scored_tokens their rows.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5,
                1, 2.5, 5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PREFIX = "specdec:"


@dataclass
class _Seen:
    """What the counters already hold of one running request."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0
    per_pos: list[int] = field(default_factory=list)
    generated: int = 0
    last_token_at: float = 0.0


class ServerMetrics:
    """One registry per server, so several apps in one process (tests) do not collide."""

    def __init__(self, model_name: str = "", prefix: str = PREFIX):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        p, m = prefix, {"model_name": model_name}

        def one(kind, name: str, doc: str, **kw):  # a series with only the model_name label
            return kind(p + name, doc, ["model_name"], registry=r, **kw).labels(**m)

        def family(kind, name: str, doc: str, label: str):  # labelled further: .labels(label=...)
            return kind(p + name, doc, ["model_name", label], registry=r)

        self.num_drafts = one(Counter, "spec_decode_num_drafts", "Drafts verified.")
        self.num_draft_tokens = one(Counter, "spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = one(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.num_forced_tokens = one(Counter, "spec_decode_num_forced_tokens",
                                     "Tokens a grammar forced (not drafted).")
        self._accepted_per_pos = family(
            Counter, "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted.", "position",
        )
        self.e2e_latency = one(Histogram, "e2e_request_latency_seconds",
                               "Request latency, queueing included.", buckets=_LATENCY_BUCKETS)
        self.ttft = one(Histogram, "time_to_first_token_seconds",
                        "Time from arrival to the first generated token.", buckets=_TTFT_BUCKETS)
        self.itl = one(Histogram, "inter_token_latency_seconds",
                       "Time between a running request's steps that gave it tokens.", buckets=_ITL_BUCKETS)
        self.queue_time = one(Histogram, "request_queue_time_seconds", "Time from arrival until admitted.",
                              buckets=_TTFT_BUCKETS)
        self.waiting = one(Gauge, "num_requests_waiting", "Requests in the queue.")
        self.running = one(Gauge, "num_requests_running", "Requests being decoded.")
        self.kv_usage = one(Gauge, "kv_cache_usage_perc",
                            "Fraction of KV-cache slots held by running requests.")
        self.prompt_tokens = one(Counter, "prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = one(Counter, "generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = one(Counter, "prefix_cache_queries",
                                        "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = one(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._success = family(Counter, "request_success", "Finished requests.", "finished_reason")
        self._rejected = family(Counter, "num_requests_rejected", "Requests refused.", "reason")
        self._aborted = family(Counter, "num_requests_aborted", "Requests ended before they finished.",
                               "reason")
        self.closed_by_budget = one(Counter, "num_requests_closed_by_budget",
                                    "Structured replies the token budget closed (complete and valid).")
        self.batch_size = one(Histogram, "batch_size", "Requests scored by one target forward.",
                              buckets=_BATCH_BUCKETS)
        self.batch_tokens = one(Counter, "batch_scored_tokens", "Tokens scored by target forwards.")
        self._busy = family(Counter, "model_busy_seconds", "Model-worker time, by phase.", "phase")
        self.kv_read_bytes = one(Counter, "kv_cache_read_bytes", "Cached KV bytes decode steps' rows read.")
        self.attention_seconds = one(Counter, "decode_attention_seconds",
                                     "Decode time the cost model prices the cached keys' reads at.")
        self._seen: dict[int, _Seen] = {}
        self._lock = threading.Lock()

    def bind_scheduler(self, scheduler) -> None:
        """Read queue depth, running requests and slot use at scrape time."""
        self.waiting.set_function(lambda: scheduler.queue_depth)
        self.running.set_function(lambda: scheduler.num_active)
        self.kv_usage.set_function(lambda: _slot_usage(scheduler))

    def rejected(self, reason: str) -> None:
        self._rejected.labels(model_name=self.model_name, reason=reason).inc()

    def aborted(self, reason: str) -> None:
        self._aborted.labels(model_name=self.model_name, reason=reason).inc()

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(max(0.0, seconds))

    # Called from the model worker thread (prometheus_client is thread-safe).

    def observe_step(self, request_id: int, stats, num_generated: int) -> None:
        """A running request after a step: its new speculative counts, and an inter-token
        latency sample when the step gave it tokens."""
        now = time.perf_counter()
        with self._lock:
            seen = self._seen.setdefault(request_id, _Seen())
            self._count_spec(stats, seen)
            if num_generated > seen.generated:
                if seen.generated:
                    self.itl.observe(now - seen.last_token_at)
                seen.generated, seen.last_token_at = num_generated, now

    def observe_spec(self, stats, request_id: int | None = None) -> None:
        """A request's SpecStats when it leaves the batch (finished or cancelled): what the
        steps did not count yet."""
        with self._lock:
            seen = self._seen.pop(request_id, None) if request_id is not None else None
            self._count_spec(stats, seen or _Seen())

    def _count_spec(self, stats, seen: _Seen) -> None:
        for counter, attr in ((self.num_drafts, "drafts"), (self.num_draft_tokens, "draft_tokens"),
                              (self.num_accepted_tokens, "accepted_tokens"),
                              (self.num_forced_tokens, "forced_tokens")):
            now = getattr(stats, "num_" + attr)
            if now > getattr(seen, attr):
                counter.inc(now - getattr(seen, attr))
                setattr(seen, attr, now)
        per_pos = list(stats.accepted_per_pos)
        for pos, count in enumerate(per_pos):
            before = seen.per_pos[pos] if pos < len(seen.per_pos) else 0
            if count > before:
                self._accepted_per_pos.labels(model_name=self.model_name,
                                              position=str(pos)).inc(count - before)
        seen.per_pos = per_pos

    def observe_request(self, req, result, latency_s: float) -> None:
        self.e2e_latency.observe(latency_s)
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.submitted_at)
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.prefix_cache_queries.inc(len(result.prompt_ids))
        self.prefix_cache_hits.inc(result.stats.cached_prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        self._success.labels(model_name=self.model_name, finished_reason=result.finish_reason).inc()
        if result.closed_by_budget:
            self.closed_by_budget.inc()

    def observe_batch(self, num_sequences: int, num_tokens: int) -> None:
        self.batch_size.observe(num_sequences)
        self.batch_tokens.inc(num_tokens)

    def observe_busy(self, phase: str, seconds: float) -> None:
        self._busy.labels(model_name=self.model_name, phase=phase).inc(max(0.0, seconds))

    def observe_reads(self, kv_bytes: int, attention_s: float) -> None:
        self.kv_read_bytes.inc(kv_bytes)
        self.attention_seconds.inc(max(0.0, attention_s))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _slot_usage(scheduler) -> float:
    slots = getattr(scheduler, "slots", None)
    capacity = getattr(slots, "max_slots", None) or scheduler.max_batch
    return min(1.0, getattr(slots, "in_use", scheduler.num_active) / max(1, capacity))
