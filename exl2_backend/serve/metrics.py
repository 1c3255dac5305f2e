"""/metrics: the worker's EngineLoop.stats() in the Prometheus text exposition format."""

from __future__ import annotations

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(stats: dict, model_id: str) -> str:
    """EngineLoop.stats() (from the worker) -> Prometheus text exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    backend = stats.get("backend") or {}

    class _Collector:
        def collect(self):
            def gauge(name, doc, value):
                g = GaugeMetricFamily(f"exl2_backend_{name}", doc, labels=["model"])
                g.add_metric([model_id], float(value or 0))
                return g

            def counter(name, doc, values: dict, label: str):
                c = CounterMetricFamily(f"exl2_backend_{name}", doc, labels=["model", label])
                for key, value in sorted(values.items()):
                    c.add_metric([model_id, str(key)], float(value))
                return c

            yield gauge("healthy", "1 while the engine serves requests", 1 if stats.get("healthy") else 0)
            yield gauge("queue_length", "requests waiting for admission", stats.get("queue_length"))
            yield gauge("active_sequences", "sequences in the running batch", stats.get("active_sequences"))
            yield gauge("max_batch_size", "most sequences that run together", stats.get("max_batch_size"))
            yield gauge("tokens_per_second", "generated tokens per second over the last 10 s",
                        stats.get("tokens_per_second"))
            yield gauge("kv_pages_total", "KV cache pages", backend.get("total_pages"))
            yield gauge("kv_pages_free", "KV cache pages not held by any sequence", backend.get("free_pages"))
            yield gauge("kv_pages_reserved", "free pages promised to running sequences", backend.get("reserved_pages"))
            yield gauge("kv_free_tokens", "KV cache tokens neither held nor reserved", backend.get("free_tokens"))
            yield gauge("kv_page_size", "tokens per KV page", backend.get("page_size"))
            yield gauge("max_seq_len", "context length (prompt + completion)", backend.get("max_seq_len"))
            yield gauge("prefix_cache_pages", "KV pages indexed by the prefix cache (held or evictable)",
                        backend.get("prefix_cached_pages"))
            yield gauge("prefix_cache_evictable_pages", "cached KV pages no sequence holds (reusable, or free space)",
                        backend.get("prefix_evictable_pages"))
            yield gauge("prefix_cache_hit_rate", "share of admitted prompt tokens whose KV came from the prefix cache",
                        backend.get("prefix_hit_rate"))
            for key, doc in (("hit_tokens", "prompt tokens reused from the prefix cache"),
                             ("lookup_tokens", "prompt tokens looked up in the prefix cache"),
                             ("evictions", "cached KV pages evicted to make room")):
                c = CounterMetricFamily(f"exl2_backend_prefix_cache_{key}", doc, labels=["model"])
                c.add_metric([model_id], float(backend.get(f"prefix_{key}") or 0))
                yield c
            if backend.get("spec_mode"):  # speculative decoding (exl2_backend/spec/)
                yield gauge("spec_acceptance_rate", "accepted / proposed draft tokens",
                            backend.get("spec_acceptance_rate"))
                yield gauge("spec_mean_accepted_length", "accepted draft tokens per verify step that drafted",
                            backend.get("spec_mean_accepted_length"))
                yield gauge("spec_tokens_per_step", "tokens per sequence per speculative step",
                            backend.get("spec_tokens_per_step"))
                for key, doc in (("spec_proposed_tokens", "draft tokens proposed"),
                                 ("spec_accepted_tokens", "draft tokens accepted")):
                    c = CounterMetricFamily(f"exl2_backend_{key}", doc, labels=["model"])
                    c.add_metric([model_id], float(backend.get(key) or 0))
                    yield c
            yield counter("requests", "finished requests by outcome", stats.get("requests") or {}, "outcome")
            yield counter("rejected", "requests refused by reason", stats.get("rejected") or {}, "reason")
            yield counter("steps", "engine steps by kind", stats.get("steps") or {}, "kind")
            yield counter("step_seconds", "seconds spent in engine steps by kind", stats.get("step_seconds") or {},
                          "kind")
            pt = CounterMetricFamily("exl2_backend_prompt_tokens", "prompt tokens admitted", labels=["model"])
            pt.add_metric([model_id], float(stats.get("prompt_tokens_total") or 0))
            yield pt
            gt = CounterMetricFamily("exl2_backend_generation_tokens", "tokens generated", labels=["model"])
            gt.add_metric([model_id], float(stats.get("generation_tokens_total") or 0))
            yield gt

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry).decode()
