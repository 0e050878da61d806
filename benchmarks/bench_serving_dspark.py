"""DSpark against target-only through `atom serve`: TPOT and output throughput.

Serves the model twice, target-only and then with DSpark, each through
`scripts/ci/serve.sh` (start, wait for /health and a one-token warm-up, stop), and
runs `atom.benchmarks.benchmark_serving` against each server several times with the
same random prompts. The first pass meets every batch shape for the first time
(Triton compiles a kernel per new specialization, about a second each on a fresh
machine) and is only printed; the figures come from the median of the timed passes
that follow (`--timed-passes`, 3 by default: a single pass of this length moved by
up to 1.5x between runs on one machine), and DSpark's ratio is that of the
medians. Issue 20's serving shape is the default: concurrency 16, 128 tokens in and
64 out, bf16. Each `--dspark-args` adds a DSpark server with those flags (and its
ratio to the one target-only server), so variants compare within one run.

    python benchmarks/bench_serving_dspark.py --device cuda --dtype bfloat16
    python benchmarks/bench_serving_dspark.py --serve-args "--scheduler-delay-factor 0.5"
    python benchmarks/bench_serving_dspark.py --dspark-args "" \
        --dspark-args "--scheduler-delay-factor 0.5"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def serve_and_measure(
    args: argparse.Namespace, label: str, serve_flags: list[str], scratch: Path
) -> list[dict]:
    """The timed passes' records of benchmark_serving against one server."""
    client = [
        sys.executable,
        "-m",
        "atom.benchmarks.benchmark_serving",
        "--base-url",
        f"http://127.0.0.1:{args.port}",
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--ignore-eos",
        "--save-result",
        "--result-dir",
        str(scratch),
    ]
    # One shell line runs every pass against the same server.
    names = ["first"] + [f"timed-{i + 1}" for i in range(args.timed_passes)]
    passes = " && ".join(
        shlex.join([*client, "--result-filename", f"{label}-{name}.json"])
        for name in names
    )
    flags = ["--model", args.model, "--device", args.device, "--dtype", args.dtype]
    flags += shlex.split(args.serve_args)
    command = [
        "bash",
        str(REPO / "scripts/ci/serve.sh"),
        "--port",
        str(args.port),
        "--log",
        str(Path(args.log_dir) / f"server-{label}.log"),
        "--ready-timeout",
        "600",
        "--serve-args",
        " ".join(flags + serve_flags),
        "--",
        "bash",
        "-c",
        passes,
    ]
    print(f"=== {label}: atom serve {' '.join(flags + serve_flags)}", flush=True)
    subprocess.run(command, check=True, env={**os.environ, "PYTHON": sys.executable})
    return [json.loads((scratch / f"{label}-{n}.json").read_text()) for n in names[1:]]


def median_pass(records: list[dict]) -> dict:
    """The pass whose output throughput is the median (the lower one of an even
    count), so that every figure printed comes from one real pass."""
    ranked = sorted(records, key=lambda record: record["output_throughput"])
    return ranked[(len(ranked) - 1) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-kimi-k3")
    parser.add_argument("--draft-model", default="tiny-kimi-k3-dspark")
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--serve-args", default="", help="more `atom serve` flags, for both servers"
    )
    parser.add_argument(
        "--dspark-args",
        action="append",
        help="flags of one more DSpark server (repeatable; default: one, no flags)",
    )
    parser.add_argument(
        "--timed-passes",
        type=int,
        default=3,
        help="passes timed after the warm one; the median pass is reported",
    )
    parser.add_argument("--port", type=int, default=8017)
    parser.add_argument("--log-dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    spec_flags = [
        "--method",
        "dspark",
        "--draft-model",
        args.draft_model,
        "--num-speculative-tokens",
        str(args.num_speculative_tokens),
    ]
    servers = [("target-only", [])]
    variants = args.dspark_args or [""]
    for index, extra in enumerate(variants):
        label = "dspark" if len(variants) == 1 else f"dspark-{index + 1}"
        servers.append((label, spec_flags + shlex.split(extra)))
    with tempfile.TemporaryDirectory() as scratch:
        records = {
            label: serve_and_measure(args, label, flags, Path(scratch))
            for label, flags in servers
        }
    print()
    medians = {label: median_pass(passes) for label, passes in records.items()}
    for (label, flags), passes in zip(servers, records.values()):
        record = medians[label]
        rates = sorted(p["output_throughput"] for p in passes)
        extra = " ".join(flags[len(spec_flags) :]) if label != "target-only" else ""
        print(
            f"{label}: output {record['output_throughput']:.1f} tok/s "
            f"(median of {len(rates)} passes; {rates[0]:.1f} to {rates[-1]:.1f}), "
            f"TPOT mean {record['mean_tpot_ms']:.2f} ms "
            f"(median {record['median_tpot_ms']:.2f}), "
            f"TTFT mean {record['mean_ttft_ms']:.1f} ms, "
            f"{record['completed']}/{args.num_prompts} requests"
            + (f" [{extra}]" if extra else "")
        )
    baseline = medians["target-only"]["output_throughput"]
    for label, _ in servers[1:]:
        ratio = medians[label]["output_throughput"] / baseline
        print(f"{label} / target-only output throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
