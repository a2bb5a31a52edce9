"""Prometheus metrics, named like vLLM's (``vllm:`` -> ``radixserve:``) so existing dashboards adapt easily.

Each app owns its own ``CollectorRegistry`` (several apps can live in one process, e.g. in tests). Request
metrics are recorded by the server from the timestamps of each request's output stream; the gauges are
refreshed from ``Engine.server_info()`` when /metrics is scraped.

Queue time is the engine's own measure (arrival to admission into a batch), carried on a request's first output.
Under pressure: ``request_refused{reason="queue_full"}`` counts 429s, ``retractions`` and ``evicted_tokens`` follow
the engine's totals (exported as counters by their increase since the previous scrape). See docs/operations.md.

Grammar queue: ``num_requests_waiting_grammar`` counts the requests whose constraint is compiling, both those the
server awaits before submitting (tracked live here) and those in the engine's own grammar queue (as of the last
scrape). ``grammar_compiler`` carries the compiler's counters from ``server_info()["grammar"]`` (cache hits and
misses, compiles, errors, timeouts, compile seconds, cache size), one series per ``stat``.

KV tier (``--enable-hierarchical-cache``): ``kv_tier_*`` counters follow the tier's totals (tokens served from it,
loads and their seconds, bytes read and written, chunks written, saves dropped for a full write queue, files
skipped as invalid); ``kv_tier_stored_bytes`` / ``kv_tier_stored_chunks`` are gauges of what it holds.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from radixserve.runtime.request import ReqOutput

PREFIX = "radixserve:"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str) -> None:
        # ``*_created`` series double every counter and histogram and no dashboard reads them (vLLM drops them too).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge(f"{PREFIX}num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests waiting for admission.", labels, registry=r)
        self.kv_usage = Gauge(
            f"{PREFIX}kv_cache_usage_perc", "Share of KV cache slots held by requests (0-1).", labels, registry=r
        )
        self.kv_cached = Gauge(
            f"{PREFIX}kv_cache_cached_tokens", "Tokens whose KV is kept in the radix prefix cache.", labels, registry=r
        )
        self.hit_rate = Gauge(
            f"{PREFIX}prefix_cache_hit_rate",
            "Share of admitted prompt tokens served from the prefix cache since start (0-1).",
            labels,
            registry=r,
        )
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", labels, registry=r)
        self.cached_tokens = Counter(
            f"{PREFIX}prompt_tokens_cached", "Prompt tokens served from the prefix cache.", labels, registry=r
        )
        self.requests = Counter(
            f"{PREFIX}request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Time to first token.", labels, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between two outputs of a request.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            f"{PREFIX}request_queue_time_seconds",
            "Time from arrival to admission into a running batch.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_len = Histogram(
            f"{PREFIX}request_prompt_tokens", "Prompt length per request.", labels, buckets=TOKEN_BUCKETS, registry=r
        )
        self.gen_len = Histogram(
            f"{PREFIX}request_generation_tokens",
            "Tokens generated per request.",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.grammar_waiting = Gauge(
            f"{PREFIX}num_requests_waiting_grammar",
            "Requests waiting for their grammar (JSON schema, regex, ...) to compile.",
            labels,
            registry=r,
        )
        self.grammar_stats = Gauge(
            f"{PREFIX}grammar_compiler",
            "Grammar compiler counters since start (hits, misses, compiled, errors, timeouts, compile_seconds, ...).",
            [*labels, "stat"],
            registry=r,
        )
        self.refused = Counter(
            f"{PREFIX}request_refused",
            "Requests refused at admission (reason queue_full: the waiting queue was full, HTTP 429).",
            [*labels, "reason"],
            registry=r,
        )
        self.retractions = Counter(
            f"{PREFIX}retractions",
            "Running requests sent back to the queue to free KV (the pool is short for the batch).",
            labels,
            registry=r,
        )
        self.evicted = Counter(
            f"{PREFIX}evicted_tokens", "Cached prefix tokens evicted from the radix cache.", labels, registry=r
        )
        # As vLLM's prefix_cache_queries / prefix_cache_hits: counters in tokens, which sum across replicas (a
        # hit-rate gauge does not): rate(hits) / rate(queries) is the hit rate of any set of servers.
        self.cache_queries = Counter(
            f"{PREFIX}prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (at admission).",
            labels,
            registry=r,
        )
        self.cache_hits = Counter(
            f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache (at admission).", labels, registry=r
        )
        # Speculative decoding, as vLLM's spec_decode counters: rate(accepted) / rate(draft) is the acceptance
        # rate, (rate(accepted) + rate(verifications)) / rate(verifications) the tokens a verification yields.
        self.spec_drafts = Counter(
            f"{PREFIX}spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).", labels, registry=r
        )
        self.spec_accepted = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens", "Draft tokens accepted by verification.", labels, registry=r
        )
        self.spec_steps = Counter(
            f"{PREFIX}spec_decode_num_verifications",
            "Speculative verifications (one per request and step with drafts).",
            labels,
            registry=r,
        )
        tier_counters = {
            "hit_tokens": "Prompt tokens whose KV was loaded from the KV tier instead of computed.",
            "loads": "Loads from the KV tier (one per request admission that found chunks there).",
            "load_seconds": "Seconds spent loading KV from the KV tier into the pool.",
            "bytes_read": "Bytes of KV read from the KV tier's files.",
            "bytes_written": "Bytes of KV written to the KV tier's files.",
            "chunks_written": "KV chunks written to the KV tier.",
            "writes_dropped": "KV chunks not saved because the tier's write queue was full.",
            "files_skipped": "KV tier files skipped as invalid (truncated, corrupt, another model's).",
        }
        self.tier_counters = {
            name: Counter(f"{PREFIX}kv_tier_{name}", doc, labels, registry=r) for name, doc in tier_counters.items()
        }
        self._tier_seen: dict[str, float] = dict.fromkeys(tier_counters, 0.0)
        self.tier_bytes = Gauge(
            f"{PREFIX}kv_tier_stored_bytes", "Bytes of KV files in the KV tier.", labels, registry=r
        )
        self.tier_chunks = Gauge(f"{PREFIX}kv_tier_stored_chunks", "KV chunks in the KV tier.", labels, registry=r)
        # Engine totals at the last scrape, per counter that follows one.
        self._seen = dict.fromkeys(
            ("retractions", "evicted_tokens", "prompt_tokens", "cached_prompt_tokens")
            + ("spec_draft_tokens", "spec_accepted_tokens", "spec_steps"),
            0,
        )
        self.model_name = model_name
        for counter in (
            self.retractions,
            self.evicted,
            self.cache_queries,
            self.cache_hits,
            self.spec_drafts,
            self.spec_accepted,
            self.spec_steps,
        ):
            counter.labels(model_name)  # exported from the start, at 0, so that rate() has a first sample
        self.awaiting_grammar = 0  # compiles the server awaits before submitting (event-loop thread only)
        self._engine_grammar_queue = 0
        self.grammar_waiting.labels(model_name).set(0)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def queued(self, seconds: float) -> None:
        self.queue.labels(self.model_name).observe(seconds)

    def next_output(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def finished(self, out: ReqOutput, seconds: float) -> None:
        m = self.model_name
        reason = out.finish_reason.value if out.finish_reason is not None else "abort"
        self.requests.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(out.prompt_tokens)
        self.generation_tokens.labels(m).inc(out.completion_tokens)
        self.cached_tokens.labels(m).inc(out.cached_tokens)
        self.prompt_len.labels(m).observe(out.prompt_tokens)
        self.gen_len.labels(m).observe(out.completion_tokens)
        self.e2e.labels(m).observe(seconds)

    def abandoned(self) -> None:
        """A request the server aborted because its client went away (its final output is never read)."""
        self.requests.labels(self.model_name, "abort").inc()

    def refused_request(self, reason: str) -> None:
        self.refused.labels(self.model_name, reason).inc()

    def grammar_wait(self, delta: int) -> None:
        """A request started (+1) or stopped (-1) awaiting its grammar's compilation in the server."""
        self.awaiting_grammar += delta
        self.grammar_waiting.labels(self.model_name).set(self.awaiting_grammar + self._engine_grammar_queue)

    def refresh(self, info: dict[str, Any]) -> None:
        m = self.model_name
        kv = info["kv_cache"]
        self.running.labels(m).set(info["num_running_requests"])
        self.waiting.labels(m).set(info["num_waiting_requests"])
        self.kv_usage.labels(m).set(kv["in_use_tokens"] / kv["total_tokens"] if kv["total_tokens"] else 0.0)
        self.kv_cached.labels(m).set(kv["cached_tokens"])
        stats = info.get("cache_stats", {})
        self.hit_rate.labels(m).set(stats.get("cache_hit_rate", 0.0))
        followed = (
            ("retractions", self.retractions),
            ("evicted_tokens", self.evicted),
            ("prompt_tokens", self.cache_queries),
            ("cached_prompt_tokens", self.cache_hits),
            ("spec_draft_tokens", self.spec_drafts),
            ("spec_accepted_tokens", self.spec_accepted),
            ("spec_steps", self.spec_steps),
        )
        for name, counter in followed:
            total = int(stats.get(name, 0))
            if total > self._seen[name]:  # the engine's totals only grow: export the increase as a counter
                counter.labels(m).inc(total - self._seen[name])
                self._seen[name] = total
        tier = info.get("kv_tier") or {}
        for name, counter in self.tier_counters.items():
            total = float(tier.get(name, 0))
            if total > self._tier_seen[name]:
                counter.labels(m).inc(total - self._tier_seen[name])
                self._tier_seen[name] = total
        if tier:
            self.tier_bytes.labels(m).set(tier.get("stored_bytes", 0))
            self.tier_chunks.labels(m).set(tier.get("stored_chunks", 0))
        grammar = dict(info.get("grammar") or {})
        self._engine_grammar_queue = int(grammar.pop("queue", 0))
        self.grammar_wait(0)
        for stat, value in grammar.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.grammar_stats.labels(m, stat).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
