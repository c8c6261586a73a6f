"""Prometheus metrics for the server, named as vLLM names them (prefix `specdec:`).

Speculative counters (exposed with the `_total` suffix), as in vLLM's spec_decode metrics:
- spec_decode_num_drafts: steps that verified a non-empty draft;
- spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens;
- spec_decode_num_accepted_tokens_per_pos{position}: drafts whose token at `position` was kept;
- spec_decode_num_forced_tokens (ours): tokens a grammar forced (structured output, tool
  calls). They are scored and always kept, but are not the drafter's: they stay out of the
  draft and accepted counts, so the acceptance rate measures the drafter alone.
Acceptance rate = rate(accepted_tokens) / rate(draft_tokens); mean acceptance length
= 1 + accepted_tokens / drafts (bonus token included).
"""

from __future__ import annotations

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    """One registry per server, so several apps in one process (tests) do not collide."""

    def __init__(self, prefix: str = "specdec:"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        p = prefix
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Drafts verified.", registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.num_accepted_tokens = Counter(
            p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.num_forced_tokens = Counter(
            p + "spec_decode_num_forced_tokens", "Tokens a grammar forced (not drafted).", registry=r
        )
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted.",
            ["position"],
            registry=r,
        )
        self.e2e_latency = Histogram(
            p + "e2e_request_latency_seconds", "Request latency, queueing included.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.waiting = Gauge(p + "num_requests_waiting", "Requests in the queue.", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests being decoded.", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", registry=r)
        self.prefix_cache_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.request_success = Counter(
            p + "request_success", "Finished requests.", ["finished_reason"], registry=r
        )
        self.rejected = Counter(p + "num_requests_rejected", "Requests refused.", ["reason"], registry=r)
        self.batch_size = Histogram(
            p + "batch_size", "Requests scored by one target forward.", buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_tokens = Counter(p + "batch_scored_tokens", "Tokens scored by target forwards.", registry=r)

    def bind_scheduler(self, scheduler) -> None:
        """Read queue depth and running requests at scrape time."""
        self.waiting.set_function(lambda: scheduler.queue_depth)
        self.running.set_function(lambda: scheduler.num_active)

    # Called from the model worker thread (prometheus_client is thread-safe).

    def observe_spec(self, stats) -> None:
        """A request's SpecStats, once, when it leaves the batch (finished or cancelled)."""
        if stats.num_drafts:
            self.num_drafts.inc(stats.num_drafts)
            self.num_draft_tokens.inc(stats.num_draft_tokens)
            self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        if stats.num_forced_tokens:
            self.num_forced_tokens.inc(stats.num_forced_tokens)
        for pos, count in enumerate(stats.accepted_per_pos):
            if count:
                self.accepted_per_pos.labels(position=str(pos)).inc(count)

    def observe_request(self, req, result, latency_s: float) -> None:
        self.e2e_latency.observe(latency_s)
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.submitted_at)
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.prefix_cache_queries.inc(len(result.prompt_ids))
        self.prefix_cache_hits.inc(result.stats.cached_prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        self.request_success.labels(finished_reason=result.finish_reason).inc()

    def observe_batch(self, num_sequences: int, num_tokens: int) -> None:
        self.batch_size.observe(num_sequences)
        self.batch_tokens.inc(num_tokens)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
