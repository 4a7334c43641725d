"""Prometheus metrics under the `pagedserve:` prefix, with vLLM's names and meanings.

Request and token metrics are recorded on the engine thread as deltas flow (EngineObserver), so requests
whose client went away are counted too. Engine gauges and counters are read from the engine's snapshot at
scrape time. Each app owns its registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine import SequenceDelta
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import EngineObserver

PREFIX = "pagedserve:"
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Any token is a valid method to HTTP parsers: a label per made-up one would grow the registry without bound.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


class ServerMetrics(EngineObserver):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return family.labels(model_name)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between two tokens of a sequence.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to scheduled.", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens out.", TOKEN_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per step.", ITERATION_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens, counted at finish.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self.request_success = counter("request_success", "Finished sequences.", ("finished_reason",))
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP responses.", ["route", "method", "status"], registry=self.registry
        )
        self.registry.register(_EngineCollector(engine, model_name))
        self._last_token_at: dict[tuple[str, int], float] = {}  # engine thread only

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_http(self, route: str, method: str, status: int) -> None:
        """`route` is a template or "unmatched", never a raw path; methods outside HTTP's standard ones are
        "other": the labels a client controls take few values."""
        label = method if method in HTTP_METHODS else "other"
        self.http_requests.labels(route, label, str(status)).inc()

    # ---- EngineObserver (engine thread) ------------------------------------------------------------

    def on_step(self, seconds: float, num_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)

    def on_deltas(self, deltas: list[SequenceDelta], now: float) -> None:
        for delta in deltas:
            key = (delta.request_id, delta.index)
            if delta.new_token_ids:
                self.generation_tokens.inc(len(delta.new_token_ids))
                last = self._last_token_at.get(key)
                if last is not None:
                    self.itl.observe(now - last)
                self._last_token_at[key] = now
            if delta.finished:
                self._last_token_at.pop(key, None)
                self._observe_finished(delta)

    def _observe_finished(self, delta: SequenceDelta) -> None:
        self.request_success.labels(self.model_name, delta.finish_reason).inc()
        self.request_generation_tokens.observe(delta.num_output_tokens)
        if delta.index == 0:  # the n sequences of a request share one prompt
            self.prompt_tokens.inc(delta.num_prompt_tokens)
            self.request_prompt_tokens.observe(delta.num_prompt_tokens)
        times = delta.metrics
        if times is None:
            return
        for histogram, value in (
            (self.e2e, times.e2e_latency),
            (self.queue_time, times.queue_time),
            (self.ttft, times.time_to_first_token),
        ):
            if value is not None:
                histogram.observe(value)


class _EngineCollector(Collector):
    """Engine gauges and counters, read from its latest snapshot at scrape time."""

    FAMILIES = (  # (kind, name, help, EngineSnapshot field)
        (GaugeMetricFamily, "num_requests_running", "Sequences running.", "num_running"),
        (GaugeMetricFamily, "num_requests_waiting", "Sequences waiting.", "num_waiting"),
        (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", "kv_cache_usage"),
        (GaugeMetricFamily, "num_kv_blocks", "KV cache blocks in all.", "num_kv_blocks"),
        (GaugeMetricFamily, "num_free_kv_blocks", "KV blocks free, or cached with no reference.", "num_free_blocks"),
        (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up.", "prefix_cache_queries"),
        (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found cached.", "prefix_cache_hits"),
        (CounterMetricFamily, "num_preemptions", "Preemptions.", "num_preemptions"),
        (CounterMetricFamily, "structured_output_requests", "Requests with a constraint.", "constrained_requests"),
        (CounterMetricFamily, "grammar_compile_seconds", "Compiling constraints.", "grammar_compile_seconds"),
        (CounterMetricFamily, "grammar_mask_seconds", "Filling token masks.", "grammar_mask_seconds"),
        (
            CounterMetricFamily,
            "grammar_mask_wait_seconds",
            "Steps waiting for token masks after their forward.",
            "grammar_mask_wait_seconds",
        ),
        (
            CounterMetricFamily,
            "jump_forward_tokens",
            "Tokens a constraint forced, without a forward.",
            "jump_forward_tokens",
        ),
        (
            CounterMetricFamily,
            "spec_decode_num_drafts",
            "Sequence steps that verified proposed tokens.",
            "spec_decode_num_drafts",
        ),
        (
            CounterMetricFamily,
            "spec_decode_num_draft_tokens",
            "Proposed tokens verified.",
            "spec_decode_num_draft_tokens",
        ),
        (
            CounterMetricFamily,
            "spec_decode_num_accepted_tokens",
            "Proposed tokens accepted.",
            "spec_decode_num_accepted_tokens",
        ),
        (GaugeMetricFamily, "tensor_parallel_size", "Ranks the model is split over.", "tensor_parallel_size"),
        (
            CounterMetricFamily,
            "tensor_parallel_communication_seconds",
            "Rank 0's time in tensor-parallel collectives (all-reduces, gathers).",
            "communication_seconds",
        ),
    )

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        snapshot = self._engine.snapshot()
        for kind, name, doc, field in self.FAMILIES:
            family = kind(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(self._labels, getattr(snapshot, field))
            yield family
        yield self._queue_places()
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by their position in the proposal (0 first).",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(snapshot.spec_decode_num_accepted_tokens_per_pos or ()):
            per_position.add_metric([*self._labels, str(position)], count)
        yield per_position

    def _queue_places(self) -> Metric:
        """Read on the API side, where places are reserved: with no request left, none is held (else a leak)."""
        family = GaugeMetricFamily(
            PREFIX + "num_queue_places_held",
            "Waiting-queue places held: sequences not yet scheduled, and requests admitted but not yet submitted.",
            labels=["model_name"],
        )
        family.add_metric(self._labels, self._engine.queue_places_held())
        return family
