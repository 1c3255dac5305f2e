"""/metrics: the worker's EngineLoop.stats() in the Prometheus text exposition format."""

from __future__ import annotations

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, help, key): gauges of the loop's stats, then of the backend's (engine) stats
LOOP_GAUGES = (
    ("queue_length", "requests waiting for admission", "queue_length"),
    ("active_sequences", "sequences in the running batch", "active_sequences"),
    ("max_batch_size", "most sequences that run together", "max_batch_size"),
    ("tokens_per_second", "generated tokens per second over the last 10 s", "tokens_per_second"),
)
BACKEND_GAUGES = (
    ("kv_pages_total", "KV cache pages", "total_pages"),
    ("kv_pages_free", "KV cache pages not held by any sequence", "free_pages"),
    ("kv_pages_reserved", "free pages promised to running sequences", "reserved_pages"),
    ("kv_free_tokens", "KV cache tokens neither held nor reserved", "free_tokens"),
    ("kv_page_size", "tokens per KV page", "page_size"),
    ("max_seq_len", "context length (prompt + completion)", "max_seq_len"),
    ("prefix_cache_pages", "KV pages indexed by the prefix cache (held or evictable)", "prefix_cached_pages"),
    ("prefix_cache_evictable_pages", "cached KV pages no sequence holds (reusable, or free space)",
     "prefix_evictable_pages"),
    ("prefix_cache_hit_rate", "share of admitted prompt tokens whose KV came from the prefix cache",
     "prefix_hit_rate"),
)
BACKEND_TOTALS = (
    ("prefix_cache_hit_tokens", "prompt tokens reused from the prefix cache", "prefix_hit_tokens"),
    ("prefix_cache_lookup_tokens", "prompt tokens looked up in the prefix cache", "prefix_lookup_tokens"),
    ("prefix_cache_evictions", "cached KV pages evicted to make room", "prefix_evictions"),
    ("decode_lookahead_steps", "decode steps queued behind the one in flight and used (GPU engines)",
     "lookahead_steps_used"),
    ("decode_lookahead_dropped_steps", "decode steps queued ahead and dropped: the batch changed before them",
     "lookahead_steps_dropped"),
)
SPEC_GAUGES = (  # speculative decoding (exl2_backend/spec/), when configured
    ("spec_acceptance_rate", "accepted / proposed draft tokens", "spec_acceptance_rate"),
    ("spec_mean_accepted_length", "accepted draft tokens per verify step that drafted", "spec_mean_accepted_length"),
    ("spec_tokens_per_step", "tokens per sequence per speculative step", "spec_tokens_per_step"),
)
SPEC_TOTALS = (
    ("spec_proposed_tokens", "draft tokens proposed", "spec_proposed_tokens"),
    ("spec_accepted_tokens", "draft tokens accepted", "spec_accepted_tokens"),
)
LOOP_COUNTERS = (  # (name, help, key, label): counters with one sample per label value
    ("requests", "finished requests by outcome", "requests", "outcome"),
    ("rejected", "requests refused by reason", "rejected", "reason"),
    ("steps", "engine steps by kind", "steps", "kind"),
    ("step_seconds", "seconds spent in engine steps by kind", "step_seconds", "kind"),
)
LOOP_TOTALS = (
    ("prompt_tokens", "prompt tokens admitted", "prompt_tokens_total"),
    ("generation_tokens", "tokens generated", "generation_tokens_total"),
)


def render_metrics(stats: dict, model_id: str) -> str:
    """EngineLoop.stats() (from the worker) -> Prometheus text exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    backend = stats.get("backend") or {}

    def one(kind, name: str, doc: str, value):
        m = kind(f"exl2_backend_{name}", doc, labels=["model"])
        m.add_metric([model_id], float(value or 0))
        return m

    def by_label(name: str, doc: str, values: dict, label: str):
        c = CounterMetricFamily(f"exl2_backend_{name}", doc, labels=["model", label])
        for key, value in sorted(values.items()):
            c.add_metric([model_id, str(key)], float(value))
        return c

    class _Collector:
        def collect(self):
            healthy = 1 if stats.get("healthy") else 0
            yield one(GaugeMetricFamily, "healthy", "1 while the engine serves requests", healthy)
            yield from (one(GaugeMetricFamily, n, d, stats.get(k)) for n, d, k in LOOP_GAUGES)
            yield from (one(GaugeMetricFamily, n, d, backend.get(k)) for n, d, k in BACKEND_GAUGES)
            yield from (one(CounterMetricFamily, n, d, backend.get(k)) for n, d, k in BACKEND_TOTALS)
            if backend.get("spec_mode"):
                yield from (one(GaugeMetricFamily, n, d, backend.get(k)) for n, d, k in SPEC_GAUGES)
                yield from (one(CounterMetricFamily, n, d, backend.get(k)) for n, d, k in SPEC_TOTALS)
            yield from (by_label(n, d, stats.get(k) or {}, label) for n, d, k, label in LOOP_COUNTERS)
            yield from (one(CounterMetricFamily, n, d, stats.get(k)) for n, d, k in LOOP_TOTALS)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry).decode()
