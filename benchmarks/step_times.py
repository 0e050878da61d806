"""Wall time of each engine step, prefill apart from decode, target-only and DSpark.

`bench_offline.py`'s tokens per second include the prefill step, which at one short
prompt on the tiny models costs as much as dozens of decode steps and is the same
for both engines; this prints the two apart. Each engine serves the same greedy
request (a held-out prompt of the trained tiny model) three times, the first two to
warm up, and times every `LLMEngine.step` of the third:

    python benchmarks/step_times.py --device cuda --num-prompts 1

A line per engine: the prefill step, the median decode step (a target forward, or a
verify and a block pass with DSpark), the tokens each decode step emits on average,
and the decode time per emitted token; then DSpark's ratio to target-only on that
last figure.
"""

from __future__ import annotations

import argparse
import statistics
import time

from atom import LLMEngine, SamplingParams
from atom.models.tiny.excerpt import held_out_prompt_ids


def step_times(engine: LLMEngine, prompts: list[list[int]], max_tokens: int):
    """(seconds of each step, tokens generated) for one pass over `prompts`."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    times, tokens = [], 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        tokens += sum(len(out.output_token_ids) for out in outputs if out.finished)
    return times, tokens


def measure(args: argparse.Namespace, draft_model: str | None) -> float:
    """Print one engine's line; its decode seconds per emitted token."""
    settings = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.num_prompts,
        enable_prefix_caching=False,  # every pass prefills in full
    )
    if draft_model is not None:
        settings |= dict(
            method="dspark",
            draft_model=draft_model,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    engine = LLMEngine(args.model, **settings)
    prompts = held_out_prompt_ids(args.num_prompts, args.input_len)
    try:
        for _ in range(2):
            step_times(engine, prompts, args.output_len)
        times, tokens = step_times(engine, prompts, args.output_len)
    finally:
        engine.close()
    # The first step prefills every prompt (one batch) and samples their first token.
    prefill, decode = times[0], times[1:]
    decoded = tokens - args.num_prompts
    per_token = sum(decode) / decoded
    label = "dspark" if draft_model else "target-only"
    print(
        f"{label}: prefill step {1e3 * prefill:.2f} ms, {len(decode)} decode steps "
        f"of median {1e3 * statistics.median(decode):.3f} ms, "
        f"{decoded / len(decode):.2f} tokens a step, "
        f"{1e6 * per_token:.1f} us of decode a token",
        flush=True,
    )
    return per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-kimi-k3")
    parser.add_argument("--draft-model", default="tiny-kimi-k3-dspark")
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    target = measure(args, None)
    dspark = measure(args, args.draft_model)
    print(f"dspark / target-only, decode time a token: {target / dspark:.2f}x")


if __name__ == "__main__":
    main()
