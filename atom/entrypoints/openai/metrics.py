"""Engine statistics: Prometheus text exposition and the periodic log lines."""

import asyncio
import logging
import math
import time
from typing import Any

from atom.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError

logger = logging.getLogger(__name__)

PREFIX = "atom:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (exposed name, type, stats key, help)
ENGINE_METRICS = [
    ("requests_running", "gauge", "requests_running", "Requests being decoded."),
    ("requests_waiting", "gauge", "requests_waiting", "Requests not yet scheduled."),
    ("kv_cache_blocks_used", "gauge", "kv_cache_blocks_used", "KV blocks in use."),
    ("kv_cache_blocks_free", "gauge", "kv_cache_blocks_free", "KV blocks free."),
    ("kv_cache_blocks_total", "gauge", "kv_cache_blocks_total", "KV blocks in all."),
    ("kv_cache_usage_ratio", "gauge", "kv_cache_usage_ratio", "Used / total."),
    ("prompt_tokens_total", "counter", "prompt_tokens", "Prefilled tokens."),
    ("generation_tokens_total", "counter", "generation_tokens", "Output tokens."),
    ("preemptions_total", "counter", "preemptions", "Preempted sequences."),
    ("prefix_cache_hits_total", "counter", "prefix_cache_hit_tokens", "Cached tokens."),
    (
        "prefix_cache_queries_total",
        "counter",
        "prefix_cache_queried_tokens",
        "Tokens looked up in the prefix cache.",
    ),
]
SPECULATION_METRICS = [
    (
        "spec_decode_draft_tokens_total",
        "counter",
        "total_draft_tokens",
        "Draft tokens proposed.",
    ),
    (
        "spec_decode_accepted_tokens_total",
        "counter",
        "total_accepted_tokens",
        "Draft tokens accepted.",
    ),
    (
        "spec_decode_acceptance_rate",
        "gauge",
        "acceptance_rate",
        "Accepted / proposed draft tokens.",
    ),
    (
        "spec_decode_avg_tokens_per_forward",
        "gauge",
        "avg_tokens_per_forward",
        "Tokens emitted per target forward.",
    ),
]


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample_value(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render_prometheus(
    stats: dict[str, Any], speculation: dict[str, Any] | None, model_name: str
) -> str:
    """Prometheus text format; metrics whose key the engine lacks are left out."""
    labels = f'{{model_name="{_label_value(model_name)}"}}'
    lines = []
    sources = [(ENGINE_METRICS, stats), (SPECULATION_METRICS, speculation or {})]
    for metrics, values in sources:
        for name, kind, key, help_text in metrics:
            if values.get(key) is None:
                continue
            lines.append(f"# HELP {PREFIX}{name} {help_text}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            lines.append(f"{PREFIX}{name}{labels} {_sample_value(values[key])}")
    return "\n".join(lines) + "\n"


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
