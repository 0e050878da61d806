"""Where a prefill's time goes: kernel tables and the host's share, on CUDA.

Builds the checkpoint of `bench_vs_transformers.py` (same presets and engine
settings) and, at each batch size, profiles the prefill of that many prompts (the
engine steps until every request holds its first token) under `torch.profiler`,
after two unprofiled runs of the same shape (the first can pay for fla's
autotuning). It prints the prefill's wall time, its steps, the GPU kernel time, how
long the host waited for the device, and the kernels that take the most time.
`bench_vs_transformers.py` counts the prefill in every throughput it prints.

    python benchmarks/profile_prefill.py --device cuda --batch-sizes 32,128
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from bench_vs_transformers import (
    DTYPES,
    PRESETS,
    atom_engine_kwargs,
    synchronize,
)
from profile_decode import checkpoint_and_prompts, host_wait_us, kernel_times
from torch.profiler import ProfilerActivity, profile

from atom import LLMEngine, SamplingParams


def profile_prefill(
    engine: LLMEngine, prompts: list[list[int]], top: int, device: str
) -> None:
    """Profile one prefill of `prompts` (first tokens only) and print its table."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(2):
        engine.generate(prompts, params)
    for prompt in prompts:
        engine.add_request(prompt, params, final_only=True)
    synchronize(device)
    steps = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    kernels = kernel_times(prof)
    gpu_ms = sum(t for t, _ in kernels.values()) / 1e3
    tokens = sum(len(p) for p in prompts)
    print(
        f"\n## batch {len(prompts)} ({tokens} prompt tokens): prefill {wall_ms:.1f} ms "
        f"wall (profiled) in {steps} steps, GPU kernels {gpu_ms:.1f} ms, host waits "
        f"{host_wait_us(prof) / 1e3:.1f} ms for the device, "
        f"{sum(n for _, n in kernels.values())} kernels"
    )
    whole = sum(t for t, _ in kernels.values()) or 1.0
    for name, (total, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(
            f"{100 * total / whole:5.1f} %  {total / 1e3:8.2f} ms  x{count:<5d} "
            f"{name[:110]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="issue10")
    parser.add_argument("--batch-sizes", default="32,128")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transformers-fla", action="store_true")
    parser.add_argument(
        "--checkpoint",
        help="folder for the checkpoint; reused if it holds one (default: temp)",
    )
    args = parser.parse_args()
    # The engine settings of bench_vs_transformers.py, its defaults included.
    args.online_quant_config = args.async_scheduling = None
    args.kv_cache_dtype, args.enforce_eager = "auto", False
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder, prompts = checkpoint_and_prompts(args, batches, tmp)
        engine = LLMEngine(str(folder), **atom_engine_kwargs(args, batches))
        try:
            for batch in batches:
                profile_prefill(engine, prompts[:batch], args.top, args.device)
        finally:
            engine.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
