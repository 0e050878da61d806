"""Where a DSpark step's time goes, against a target-only decode step.

Runs the same greedy batch (held-out prompts of the trained tiny model) through a
target-only engine and a DSpark engine, three times each after a warm-up on the whole
batch: once timed, once under cProfile (the host's Python functions, by cumulative
and own time) and once under `torch.profiler` (device kernels per step). A step is
one target forward: a decode for target-only, a verify + block pass for DSpark.

The timed run also times every `LLMEngine.step`: tokens per second include the
prefill step, which at one short prompt on the tiny models weighs as much as dozens
of decode steps and is the same for both engines, so each engine's line gives its
prefill step, its median decode step and its decode time per emitted token, and the
last line DSpark's ratio to target-only on that figure. `--times-only` skips the two
profiles.

    python benchmarks/profile_spec_step.py --device cuda --num-prompts 16
    python benchmarks/profile_spec_step.py --device cuda --num-prompts 1 --times-only
    python benchmarks/profile_spec_step.py --device cuda --num-prompts 1 --times-only \
        --prefill-capture-sizes 16,32,64,128,256   # the prefill step replayed
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from atom import LLMEngine, SamplingParams
from atom.model_engine.arg_utils import parse_prefill_capture_sizes
from atom.models.tiny.excerpt import held_out_prompt_ids


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[int, list[float]]:
    """Generate every prompt; (tokens generated, seconds of each engine step)."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    tokens, times = 0, []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        tokens += sum(len(o.output_token_ids) for o in outputs if o.finished)
    return tokens, times


def decode_time_per_token(label: str, tokens: int, times: list[float], prompts: int):
    """Print the prefill step apart from the decode steps; decode seconds per
    decoded token. The first step prefills every prompt (one batch) and samples
    their first tokens."""
    decode, decoded = times[1:], tokens - prompts
    per_token = sum(decode) / decoded
    print(
        f"{label} steps: prefill {1e3 * times[0]:.2f} ms, {len(decode)} decode "
        f"steps of median {1e3 * statistics.median(decode):.3f} ms, "
        f"{decoded / len(decode):.2f} tokens a step, {1e6 * per_token:.1f} us of "
        "decode a token",
        flush=True,
    )
    return per_token


def profile_engine(args: argparse.Namespace, spec: bool) -> float:
    """Time and profile one engine; its decode seconds per decoded token."""
    # The runs repeat one batch: no prefix cache, so each prefills in full.
    settings = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.num_prompts,
        enable_prefix_caching=False,
    )
    if args.prefill_capture_sizes is not None:
        settings["prefill_capture_sizes"] = args.prefill_capture_sizes
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
            tokens, times = run_batch(engine, prompts, params)
            synchronize(args.device)
            elapsed = time.perf_counter() - start
            print(
                f"{label} {run}: {tokens} tokens in {elapsed:.3f} s = "
                f"{tokens / elapsed:.1f} tok/s, {len(times)} engine steps, "
                f"{1e3 * elapsed / len(times):.2f} ms/step (prefill included)",
                flush=True,
            )
        per_token = decode_time_per_token(label, tokens, times, len(prompts))
        if args.times_only:
            return per_token
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
    return per_token


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
    parser.add_argument("--times-only", action="store_true")
    parser.add_argument(
        "--prefill-capture-sizes",
        type=parse_prefill_capture_sizes,
        help="comma list of one-prompt prefill token counts to capture as CUDA "
        "graphs, e.g. 16,32,64,128,256; '' for none (default: the engine's)",
    )
    args = parser.parse_args()
    target, dspark = (profile_engine(args, spec) for spec in (False, True))
    print(f"dspark / target-only, decode time a token: {target / dspark:.2f}x")


if __name__ == "__main__":
    main()
