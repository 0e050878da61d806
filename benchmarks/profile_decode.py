"""Where a decode step's time goes: kernel tables and the host's share, on CUDA.

Builds the checkpoint of `bench_vs_transformers.py` (same presets), starts one atom
engine with CUDA graphs and, with `--eager`, one without, and at each batch size
profiles greedy decode steps under `torch.profiler` (prefill outside the window). Per
run it prints the decode step's wall time, the GPU kernel time per step, how long the
host waited for the device (near zero: the host is the bound), the kernels per step,
the kernels that take the most time and the host's own time by op.

    python benchmarks/profile_decode.py --device cuda --batch-sizes 1,128 --eager
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_vs_transformers import (
    DTYPES,
    PRESETS,
    build_checkpoint,
    kimi_config,
    random_prompts,
    synchronize,
)
from host_overhead import add_past_prefill
from torch.profiler import ProfilerActivity, profile

from atom import LLMEngine, SamplingParams


def kernel_times(prof: profile) -> dict[str, tuple[float, int]]:
    """Kernel name -> (total microseconds, launches), device kernels only."""
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = table[event.name]
            entry[0] += event.device_time
            entry[1] += 1
    return {name: (total, count) for name, (total, count) in table.items()}


def print_step_sequence(prof: profile, per_step: int) -> None:
    """One decode step's kernels in launch order (the second-to-last step's
    window), runs of one name folded into one line: where the fusions are."""
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    window = events[-2 * per_step : -per_step] if len(events) >= 2 * per_step else []
    print(f"one step's kernels in order ({len(window)}):")
    runs: list[list] = []
    for event in window:
        if runs and runs[-1][0] == event.name:
            runs[-1][1] += 1
            runs[-1][2] += event.device_time
        else:
            runs.append([event.name, 1, event.device_time])
    for name, count, total in runs:
        print(f"  {total:7.1f} us  x{count:<3d} {name[:100]}")


# CPU-side calls in which the host waits for the device.
WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def host_wait_us(prof: profile) -> float:
    """Microseconds the host spent waiting for the device in the profile."""
    return sum(
        event.cpu_time_total
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CPU and event.name in WAITS
    )


def profile_run(
    engine: LLMEngine,
    prompts: list[list[int]],
    steps: int,
    label: str,
    top: int,
    device: str,
    sequence: bool = False,
) -> None:
    """Profile `steps` engine steps once every request decodes (no prefill in the
    window): the step's wall time, its kernels' time, and how long the host
    waited for the device. A host that waits is bound by the device; one that
    never waits is the bound itself."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up at this batch size
    params = dataclasses.replace(params, max_tokens=steps + 8)
    add_past_prefill(engine, prompts, params, final_only=True)
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize(device)
        total_s = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    step_ms = total_s / steps * 1e3
    kernels = kernel_times(prof)
    gpu_ms = sum(t for t, _ in kernels.values()) / 1e3 / steps
    wait_ms = host_wait_us(prof) / 1e3 / steps
    launches = sum(n for _, n in kernels.values()) / steps
    print(
        f"\n## {label}: decode step {step_ms:.2f} ms wall (profiled), GPU kernels "
        f"{gpu_ms:.2f} ms/step, host waits {wait_ms:.2f} ms/step for the device "
        f"(host busy {step_ms - wait_ms:.2f} ms), {launches:.0f} kernels/step"
    )
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    whole = sum(t for t, _ in kernels.values()) or 1.0
    for name, (total, count) in ranked:
        print(
            f"{100 * total / whole:5.1f} %  {total / steps:8.1f} us/step "
            f"{count / steps:6.1f}/step  {name[:110]}"
        )
    if sequence:
        print_step_sequence(prof, round(launches))
    # The host's own work, by torch op and CUDA runtime call: where a host-bound
    # step spends its time.
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=50
        )
    )


def checkpoint_and_prompts(
    args: argparse.Namespace, batches: list[int], tmp: str
) -> tuple[Path, list[list[int]]]:
    """The checkpoint folder (written under `tmp` unless `--checkpoint` holds one)
    and prompts for the largest batch, as `bench_vs_transformers.py` makes them."""
    preset = dataclasses.replace(PRESETS[args.preset], dtype=args.dtype)
    config = kimi_config(preset)
    limit = min(config.bos_token_id, config.eos_token_id, config.pad_token_id)
    prompts = random_prompts(max(batches), args.input_len, limit, args.seed)
    folder = Path(args.checkpoint or Path(tmp) / "kimi-linear")
    if not (folder / "config.json").is_file():
        build_checkpoint(preset, folder, args)
    return folder, prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="issue10")
    parser.add_argument("--batch-sizes", default="1,128")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--eager", action="store_true", help="also profile eager")
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transformers-fla", action="store_true")
    parser.add_argument(
        "--sequence", action="store_true", help="print one step's kernels in order"
    )
    parser.add_argument(
        "--checkpoint",
        help="folder for the checkpoint; reused if it holds one (default: temp)",
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder, prompts = checkpoint_and_prompts(args, batches, tmp)
        for eager in [False, True] if args.eager else [False]:
            engine = LLMEngine(
                str(folder),
                device=args.device,
                dtype=args.dtype,
                max_num_seqs=max(batches),
                max_model_len=args.input_len + args.steps + 16,
                enable_prefix_caching=False,
                enforce_eager=eager,
            )
            try:
                for batch in batches:
                    label = f"{'eager' if eager else 'graphs'}, batch {batch}"
                    profile_run(
                        engine,
                        prompts[:batch],
                        args.steps,
                        label,
                        args.top,
                        args.device,
                        args.sequence,
                    )
            finally:
                engine.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
