"""Server metrics for Prometheus (`/metrics`) and the periodic stats log lines.

Two sources, both read one way: the engine's cumulative counters and gauges,
fetched from the engine thread when /metrics is scraped, and per-request timings,
observed on the server side as each request's outputs pass by (`track`). Names
follow vLLM's where vLLM has the same metric, so existing dashboards work;
atom's own (KV block counts) keep the `atom:` prefix.
"""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from atom.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError
from atom.model_engine.output_processor import RequestOutput

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ["model_name"]

# (exposed name, family, stats key, help); a counter's samples gain `_total`.
ENGINE_METRICS = [
    ("vllm:num_requests_running", GaugeMetricFamily, "requests_running",
     "Requests being prefilled or decoded."),
    ("vllm:num_requests_waiting", GaugeMetricFamily, "requests_waiting",
     "Requests not yet scheduled."),
    ("vllm:kv_cache_usage_perc", GaugeMetricFamily, "kv_cache_usage_ratio",
     "KV blocks used / total (1 = full)."),
    ("atom:kv_cache_blocks_used", GaugeMetricFamily, "kv_cache_blocks_used",
     "KV blocks in use."),
    ("atom:kv_cache_blocks_free", GaugeMetricFamily, "kv_cache_blocks_free",
     "KV blocks free."),
    ("atom:kv_cache_blocks_total", GaugeMetricFamily, "kv_cache_blocks_total",
     "KV blocks in all."),
    ("vllm:prompt_tokens", CounterMetricFamily, "prompt_tokens",
     "Prompt tokens of the requests taken."),
    ("vllm:generation_tokens", CounterMetricFamily, "generation_tokens",
     "Output tokens generated."),
    ("vllm:num_preemptions", CounterMetricFamily, "preemptions",
     "Sequences preempted (to be recomputed)."),
    ("vllm:prefix_cache_queries", CounterMetricFamily, "prefix_cache_queried_tokens",
     "Tokens looked up in the prefix cache."),
    ("vllm:prefix_cache_hits", CounterMetricFamily, "prefix_cache_hit_tokens",
     "Tokens found in the prefix cache."),
]  # fmt: skip
SPECULATION_METRICS = [
    ("vllm:spec_decode_num_drafts", "num_verify_steps",
     "Verify steps (one draft proposal each)."),
    ("vllm:spec_decode_num_draft_tokens", "total_draft_tokens",
     "Draft tokens verified."),
    ("vllm:spec_decode_num_accepted_tokens", "total_accepted_tokens",
     "Draft tokens accepted."),
]  # fmt: skip

# Seconds; wide enough for a tiny model on a CPU and a large one on a GPU.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
    100.0, 250.0, 500.0,
)  # fmt: skip
TOKEN_INTERVAL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class _EngineCollector(Collector):
    """The engine's counters as of the last scrape.

    They are cumulative in the engine, so they are exposed as they are instead of
    being mirrored into prometheus_client counters by differences."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict[str, Any] = {}
        self.speculation: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        for name, family, key, help_text in ENGINE_METRICS:
            if self.stats.get(key) is not None:
                yield self._family(family, name, help_text, self.stats[key])
        if self.speculation is None:
            return
        for name, key, help_text in SPECULATION_METRICS:
            value = self.speculation[key]
            yield self._family(CounterMetricFamily, name, help_text, value)
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first draft).",
            labels=[*LABELS, "position"],
        )
        for position, count in enumerate(self.speculation["accepted_per_position"]):
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position

    def _family(self, family: type, name: str, help_text: str, value: float) -> Metric:
        metric = family(name, help_text, labels=LABELS)
        metric.add_metric([self.model_name], value)
        return metric


@dataclass
class _RequestTimes:
    arrival: float
    first_token: float | None = None


class ServerMetrics:
    """One server's metrics in its own registry, so that several apps in one
    process (tests) keep separate counts."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)

        def histogram(name: str, help_text: str, buckets: tuple) -> Histogram:
            metric = Histogram(
                name, help_text, LABELS, registry=self.registry, buckets=buckets
            )
            return metric.labels(model_name)

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from the start of a request to its first output token.",
            LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Per request with 2+ output tokens: seconds after the first token "
            "per further output token.",
            TOKEN_INTERVAL_BUCKETS,
        )
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from the start of a request to its last output.",
            LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Seconds a request waited in the engine before it was first scheduled.",
            LATENCY_BUCKETS,
        )
        self._success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason (abort: the client went away).",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )

    def exposition(
        self, stats: dict[str, Any], speculation: dict[str, Any] | None
    ) -> bytes:
        """Prometheus text of everything, with the engine figures given."""
        self._engine.stats, self._engine.speculation = stats, speculation
        return generate_latest(self.registry)

    async def track(
        self, outputs: AsyncGenerator[RequestOutput, None]
    ) -> AsyncGenerator[RequestOutput, None]:
        """Pass one engine request's outputs through, observing its timings.

        Times are taken as the server receives each output, starting when the
        iteration starts (a text prompt to /v1/completions is tokenized within it).
        """
        times = _RequestTimes(arrival=time.monotonic())
        finished = False
        try:
            async for output in outputs:
                self._observe(times, output)
                finished = output.finished
                yield output
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:
                self._success.labels(self.model_name, "abort").inc()
            raise
        finally:
            await outputs.aclose()

    def _observe(self, times: _RequestTimes, output: RequestOutput) -> None:
        now = time.monotonic()
        if times.first_token is None:
            times.first_token = now
            self.time_to_first_token.observe(now - times.arrival)
            if output.queue_time is not None:
                self.queue_time.observe(output.queue_time)
        if not output.finished:
            return
        self.e2e_latency.observe(now - times.arrival)
        num_tokens = len(output.output_token_ids)
        if num_tokens > 1:
            interval = (now - times.first_token) / (num_tokens - 1)
            self.time_per_output_token.observe(interval)
        self._success.labels(self.model_name, output.finish_reason).inc()


def _read_engine_stats(engine: Any) -> tuple[dict[str, Any], str | None]:
    return engine.get_stats(), engine.format_mtp_stats_line()


class StatsLogger:
    """Logs throughput and queue state, and the MTP stats line when it changed."""

    def __init__(self, engine: AsyncEngine, interval_s: float):
        self.engine = engine
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last_prompt_tokens = 0
        self._last_generation_tokens = 0
        self._last_mtp_line: str | None = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not await self.log_once():
                return

    async def log_once(self) -> bool:
        """Log one round; False once the engine is gone."""
        try:
            stats, mtp_line = await self.engine.call(_read_engine_stats)
        except EngineDeadError:
            return False
        except Exception:
            logger.exception("reading engine stats failed; stats logging stops")
            return False
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        prompt_tokens = stats.get("prompt_tokens", 0)
        generation_tokens = stats.get("generation_tokens", 0)
        new_prompt = prompt_tokens - self._last_prompt_tokens
        new_generation = generation_tokens - self._last_generation_tokens
        running = stats.get("requests_running", 0)
        waiting = stats.get("requests_waiting", 0)
        if new_prompt or new_generation or running or waiting:
            logger.info(
                "Engine stats: prompt %.1f tok/s, generation %.1f tok/s, "
                "running %d, waiting %d, KV cache usage %.1f%%",
                new_prompt / elapsed,
                new_generation / elapsed,
                running,
                waiting,
                100.0 * stats.get("kv_cache_usage_ratio", 0.0),
            )
        if mtp_line and mtp_line != self._last_mtp_line:
            logger.info("%s", mtp_line)
            self._last_mtp_line = mtp_line
        self._last_time = now
        self._last_prompt_tokens = prompt_tokens
        self._last_generation_tokens = generation_tokens
        return True
