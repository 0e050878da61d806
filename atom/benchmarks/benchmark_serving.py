"""Online serving benchmark against an OpenAI-compatible server.

Sends random-token prompts over streaming HTTP and reports throughput and
latency: TTFT (send -> first text), TPOT ((E2EL - TTFT) / (output tokens - 1)),
ITL (gaps between streamed chunks; under speculation a chunk holds several
tokens, so ITL > TPOT) and E2EL (send -> last byte).

    python -m atom.benchmarks.benchmark_serving --model M --base-url URL \
        --dataset-name random --random-input-len 1024 --random-output-len 128 \
        --num-prompts 64 --max-concurrency 16 --ignore-eos
"""

import argparse
import asyncio
import json
import math
import os
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np

from atom.utils.arg_parser import FlexibleArgumentParser

ENDPOINTS = {
    "vllm": "/v1/completions",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


@dataclass
class Sample:
    prompt: str
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    from atom.models.tiny import is_tiny_model, resolve_model_path
    from atom.utils.tokenizer import load_tokenizer as load_folder_tokenizer

    path = name_or_path
    if not os.path.isdir(path) and is_tiny_model(path):
        path = resolve_model_path(path)
    return load_folder_tokenizer(path, trust_remote_code=trust_remote_code)


def random_samples(
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[Sample]:
    """Prompts of random non-special token ids; lengths uniform in
    [len * range_ratio, len] (range_ratio 1.0 = fixed lengths)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocabulary = [i for i in range(tokenizer.vocab_size) if i not in special]

    def length(full: int) -> int:
        return rng.randint(max(1, math.floor(full * range_ratio)), full)

    samples = []
    for _ in range(num_prompts):
        ids = rng.choices(vocabulary, k=length(input_len))
        samples.append(Sample(tokenizer.decode(ids), length(output_len)))
    return samples


def request_payload(
    backend: str, model: str, sample: Sample, ignore_eos: bool
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if backend == "openai-chat":
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
        payload["max_completion_tokens"] = sample.output_len
    else:
        payload["prompt"] = sample.prompt
        payload["max_tokens"] = sample.output_len
    return payload


def chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any]
) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                text = chunk_text(chunk)
                if text:
                    now = time.perf_counter()
                    if result.text:
                        result.itl.append(now - last)
                    else:
                        result.ttft = now - start
                    last = now
                    result.text += text
        result.latency = time.perf_counter() - start
        result.ok = bool(result.text)
        if not result.ok:
            result.error = "the server streamed no text"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = repr(error)
    return result


async def arrivals(
    count: int, rate: float, burstiness: float, seed: int
) -> AsyncIterator[int]:
    """Request indices at gamma-distributed gaps with mean 1 / rate
    (burstiness 1 = Poisson); all at once for an infinite rate."""
    rng = random.Random(seed)
    for index in range(count):
        yield index
        if math.isfinite(rate):
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def run_benchmark(
    args: argparse.Namespace, url: str, model: str, samples: list[Sample]
) -> tuple[list[RequestResult], float]:
    connections = args.max_concurrency or len(samples)
    limits = httpx.Limits(
        max_connections=connections, max_keepalive_connections=connections
    )
    timeout = httpx.Timeout(6 * 3600.0)
    async with httpx.AsyncClient(
        limits=limits, timeout=timeout, trust_env=False
    ) as client:
        for _ in range(args.num_warmups):
            payload = request_payload(args.backend, model, samples[0], args.ignore_eos)
            warmup = await send_request(client, url, payload)
            if not warmup.ok:
                raise RuntimeError(f"warm-up request failed: {warmup.error}")
        gate = asyncio.Semaphore(args.max_concurrency or len(samples))

        async def limited(sample: Sample) -> RequestResult:
            async with gate:
                payload = request_payload(args.backend, model, sample, args.ignore_eos)
                return await send_request(client, url, payload)

        start = time.perf_counter()
        tasks = []
        schedule = arrivals(len(samples), args.request_rate, args.burstiness, args.seed)
        async for index in schedule:
            tasks.append(asyncio.create_task(limited(samples[index])))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(
    results: list[RequestResult],
    duration: float,
    metrics: list[str],
    percentiles: list[float],
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    seconds = {
        "ttft": [r.ttft for r in done],
        "tpot": [
            (r.latency - r.ttft) / (r.output_tokens - 1)
            for r in done
            if r.output_tokens > 1
        ],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name in metrics:
        values_ms = np.array(seconds[name] or [0.0]) * 1000.0
        summary[f"mean_{name}_ms"] = float(values_ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(values_ms))
        summary[f"std_{name}_ms"] = float(values_ms.std())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(values_ms, p))
    return summary


def print_summary(summary: dict[str, Any], metrics: list[str], pcts: list[float]):
    rows = [
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Benchmark duration (s)", f"{summary['duration']:.2f}"),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total generated tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for name in metrics:
        label = METRIC_NAMES[name]
        rows.append((f"-- {label} --", ""))
        for stat in ["mean", "median"] + [f"p{p:g}" for p in pcts]:
            value = summary[f"{stat}_{name}_ms"]
            rows.append((f"{stat.capitalize()} {label} (ms)", f"{value:.2f}"))
    print("=" * 20 + " Serving benchmark " + "=" * 20)
    for label, value in rows:
        print(f"{label:<42}{value:>17}")
    print("=" * 59)


def served_model(client_url: str) -> tuple[str, str]:
    """(id, root) of the server's model card."""
    card = httpx.get(client_url + "/v1/models", timeout=30, trust_env=False)
    card.raise_for_status()
    entry = card.json()["data"][0]
    return entry["id"], entry.get("root") or entry["id"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(ENDPOINTS), default="vllm")
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=None, help="default: by backend")
    parser.add_argument("--model", default=None, help="default: the server's")
    parser.add_argument("--tokenizer", default=None, help="default: the model's")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--dataset-name", choices=["random"], default="random")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=1.0)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--num-warmups", type=int, default=1)
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    parser.add_argument("--metric-percentiles", default="99")
    args = parser.parse_args(argv)
    args.percentile_metrics = args.percentile_metrics.split(",")
    unknown = set(args.percentile_metrics) - set(METRIC_NAMES)
    if unknown:
        parser.error(f"--percentile-metrics: unknown {sorted(unknown)}")
    args.metric_percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    if args.num_prompts < 1 or args.burstiness <= 0 or args.request_rate <= 0:
        parser.error("--num-prompts, --burstiness and --request-rate must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = base_url + (args.endpoint or ENDPOINTS[args.backend])
    served_id, served_root = served_model(base_url)
    model = args.model or served_id
    tokenizer = load_tokenizer(
        args.tokenizer or served_root or model, args.trust_remote_code
    )
    samples = random_samples(
        tokenizer,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.seed,
    )
    results, duration = asyncio.run(run_benchmark(args, url, model, samples))
    for sample, result in zip(samples, results, strict=True):
        if result.ok and not result.output_tokens:  # the server sent no usage
            result.output_tokens = len(tokenizer.encode(result.text))
            result.prompt_tokens = len(tokenizer.encode(sample.prompt))
    summary = summarize(
        results, duration, args.percentile_metrics, args.metric_percentiles
    )
    print_summary(summary, args.percentile_metrics, args.metric_percentiles)
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"first error: {errors[0]}")
    record = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "model_id": model,
        "num_prompts": args.num_prompts,
        "request_rate": (
            args.request_rate if math.isfinite(args.request_rate) else "inf"
        ),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **summary,
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.text for r in results],
        "errors": errors,
    }
    if args.save_result:
        name = args.result_filename or (
            f"{args.backend}-{args.request_rate}qps-"
            f"concurrency{args.max_concurrency}-"
            f"{os.path.basename(model.rstrip('/'))}-{record['date']}.json"
        )
        os.makedirs(args.result_dir, exist_ok=True)
        with open(os.path.join(args.result_dir, name), "w") as file:
            json.dump(record, file, indent=2)
    return record


if __name__ == "__main__":
    main()
