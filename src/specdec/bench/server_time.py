"""Where a specdec server's model worker spent one configuration of the load benchmark, read from
its /metrics before and after (serve/metrics.py names the series). When throughput stops growing
with concurrency, these say which resource is saturated:

- `busy_share`: the worker's busy time over the wall time (near 1: the cores are the limit, not
  the clients or the queue);
- `prefill_share`: prompt chunks' share of that busy time (batching shares a decode step's
  weights, never a prefill);
- `seqs_per_step` and `rows_per_step`: requests and scored tokens per decode forward;
- `kv_mb_per_step`: cached keys and values the rows of a decode step read (batching cannot share
  them: each sequence reads its own);
- `attention_share`: of decode time, what the cost model prices those reads at.

A peer (llama-server) exposes none of these; its rows go without them.
"""

from __future__ import annotations

PREFIX = "specdec:"
FIELDS = ("busy_share", "prefill_share", "seqs_per_step", "rows_per_step", "kv_mb_per_step",
          "attention_share")


def scrape(engine: str, url: str, headers: dict) -> dict[str, float] | None:
    """The counters of the server at `url` that `split` reads (None unless it is specdec's)."""
    if engine != "specdec":
        return None
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    reply = httpx.get(url + "/metrics", headers=headers, timeout=30)
    reply.raise_for_status()
    wanted = {"model_busy_seconds_total", "kv_cache_read_bytes_total", "decode_attention_seconds_total",
              "batch_size_count", "batch_size_sum", "batch_scored_tokens_total"}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if name not in wanted:
                continue
            phase = sample.labels.get("phase")
            key = f"{name}:{phase}" if phase else name
            values[key] = values.get(key, 0.0) + sample.value
    return values


def split(before: dict[str, float] | None, after: dict[str, float] | None, wall_s: float) -> dict:
    """The FIELDS over one configuration (the counters' growth between two scrapes; {} for a
    peer, which has none: None for either)."""
    if before is None or after is None:
        return {}

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    prefill, decode = grew("model_busy_seconds_total:prefill"), grew("model_busy_seconds_total:decode")
    steps = grew("batch_size_count")
    busy = prefill + decode
    return {
        "busy_share": round(busy / wall_s, 3) if wall_s > 0 else None,
        "prefill_share": round(prefill / busy, 3) if busy > 0 else None,
        "seqs_per_step": round(grew("batch_size_sum") / steps, 2) if steps else None,
        "rows_per_step": round(grew("batch_scored_tokens_total") / steps, 2) if steps else None,
        "kv_mb_per_step": round(grew("kv_cache_read_bytes_total") / steps / 1e6, 1) if steps else None,
        "attention_share": round(grew("decode_attention_seconds_total") / decode, 3) if decode > 0 else None,
    }


def print_table(rows: list[dict]) -> None:
    """The specdec rows' time split, as a markdown table (nothing when no row has one)."""
    mine = [r for r in rows if r.get("busy_share") is not None]
    if not mine:
        return
    print("\nwhere the specdec servers' time went (from their /metrics):")
    print("| engine | concurrency | busy | prefill share | seqs / step | rows / step | KV MB / step | "
          "attention share (est.) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in mine:
        print(f"| {r['label']} | {r['concurrency']} | " + " | ".join(str(r.get(f)) for f in FIELDS) + " |")
