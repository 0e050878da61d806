"""Where a DSpark step's time goes, against a target-only decode step.

Runs the same greedy batch (held-out prompts of the trained tiny model) through a
target-only engine and a DSpark engine, three times each after a warm-up on the whole
batch: once timed, once under cProfile (the host's Python functions, by cumulative
and own time) and once under `torch.profiler` (device kernels per step). A step is
one target forward: a decode for target-only, a verify + block pass for DSpark.

    python benchmarks/profile_spec_step.py --device cuda --num-prompts 16
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from atom import LLMEngine, SamplingParams
from atom.models.tiny.excerpt import held_out_prompt_ids


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[int, int]:
    """Generate every prompt; (tokens generated, engine steps taken)."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    tokens = steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        tokens += sum(len(o.output_token_ids) for o in engine.step() if o.finished)
    return tokens, steps


def profile_engine(args: argparse.Namespace, spec: bool) -> None:
    # The runs repeat one batch: no prefix cache, so each prefills in full.
    settings = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.num_prompts,
        enable_prefix_caching=False,
    )
    if spec:
        settings.update(
            method="dspark",
            draft_model=args.draft_model,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    engine = LLMEngine(args.model, **settings)
    prompts = held_out_prompt_ids(args.num_prompts, args.input_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    label = "dspark" if spec else "target-only"
    try:
        for run in ("warm-up", "timed"):
            start = time.perf_counter()
            tokens, steps = run_batch(engine, prompts, params)
            synchronize(args.device)
            elapsed = time.perf_counter() - start
            print(
                f"{label} {run}: {tokens} tokens in {elapsed:.3f} s = "
                f"{tokens / elapsed:.1f} tok/s, {steps} engine steps, "
                f"{1e3 * elapsed / steps:.2f} ms/step (prefill included)",
                flush=True,
            )
        profiler = cProfile.Profile()
        profiler.enable()
        run_batch(engine, prompts, params)
        synchronize(args.device)
        profiler.disable()
        for key in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
            body = text.getvalue().splitlines()
            start = next(i for i, line in enumerate(body) if "ncalls" in line)
            print(f"\n## {label}: host functions by {key}")
            print("\n".join(body[start : start + args.top + 1]))
        activities = [ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            run_batch(engine, prompts, params)
            synchronize(args.device)
        sort = (
            "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
        )
        print(f"\n## {label}: torch ops by {sort}")
        print(
            prof.key_averages().table(
                sort_by=sort, row_limit=args.top, max_name_column_width=60
            )
        )
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-kimi-k3")
    parser.add_argument("--draft-model", default="tiny-kimi-k3-dspark")
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for spec in (False, True):
        profile_engine(args, spec)


if __name__ == "__main__":
    main()
