"""Offline throughput of the engine: target-only vs DSpark, across pp x tp layouts.

Prints one line per configuration (tokens/s, tok/fwd, acceptance per draft position,
and how many of its greedy sequences equal the first configuration's); each stage's
memory ledger is in the log. Prompts are cut from the tiny corpus's held-out excerpt
(`--prompts random` for random token ids). Usage:

    python benchmarks/bench_offline.py --model tiny-kimi-k3 --layouts 1x1,2x1 \
        --draft-model tiny-kimi-k3-dspark --num-prompts 16 --output-len 64
    python benchmarks/bench_offline.py --scaled-k3 1024 --layouts 1x1 --device cuda

`--batch-sizes 1,32` instead measures batch scaling: target-only, one engine in this
process (pp1 x tp1), each batch size in turn, printing tok/s and the ratio to the
first size (issue 10's CPU target: tiny-kimi-k3 at batch 32 >= 12x batch 1):

    python benchmarks/bench_offline.py --model tiny-kimi-k3 --device cpu \
        --batch-sizes 1,32

`--compare-async` adds a target-only run with `async_scheduling` after the plain one
(pp1 x tp1), so the two compare within one run:

    python benchmarks/bench_offline.py --device cuda --dtype bfloat16 \
        --num-prompts 1 --output-len 256 --compare-async

`--scaled-k3 H` builds a K3-layout checkpoint with hidden size H (same layer schedule,
AttnRes, latent MoE and KDA/MLA mix as tiny-kimi-k3, widths scaled) into a temp folder.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from atom import LLMEngine, SamplingParams
from atom.config import KV_CACHE_DTYPES
from atom.models.tiny import configs as tiny_configs
from atom.models.tiny import weights as tiny_weights
from atom.models.tiny.excerpt import held_out_prompts
from atom.models.tiny.folder import save_tensors, write_common


def scaled_k3_checkpoint(hidden: int, dtype: str, out: Path) -> str:
    """A K3-layout target whose widths scale with `hidden` (64-dim heads)."""
    config = tiny_configs.k3_config("KimiK3ForConditionalGeneration")
    text = config["text_config"]
    scale = hidden // text["hidden_size"]
    heads = max(4, hidden // 64)
    text.update(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=hidden // 2,
        moe_intermediate_size=text["moe_intermediate_size"] * scale,
        routed_expert_hidden_size=hidden // 2,
    )
    text["linear_attn_config"].update(num_heads=heads, head_dim=64)
    config["torch_dtype"] = dtype
    write_common(out, config)
    tensors = tiny_weights.materialize(tiny_weights.k3_specs(config), seed=0)
    save_tensors(tensors, out / "model.safetensors")
    return str(out)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 16) for _ in range(length)] for _ in range(n)]


def corpus_prompts(llm: LLMEngine, n: int, length: int) -> list[list[int]]:
    """Held-out verse openings, `length` tokens each (fewer if a verse is short)."""
    texts = held_out_prompts(n, words=length)
    return [llm.tokenizer.encode(t, add_special_tokens=False)[:length] for t in texts]


def sampling_params(args: argparse.Namespace, count: int) -> list[SamplingParams]:
    """One per prompt; seeded, so sampled runs repeat (greedy ones ignore it)."""
    return [
        SamplingParams(
            temperature=args.temperature,
            max_tokens=args.output_len,
            ignore_eos=True,
            seed=i,
        )
        for i in range(count)
    ]


def run(
    args: argparse.Namespace,
    model: str,
    tp: int,
    pp: int,
    spec: bool,
    run_ahead: bool = False,
) -> tuple[str, list[list[int]]]:
    kwargs = dict(
        async_scheduling=run_ahead,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(args.num_prompts, 1),
        online_quant_config=args.online_quant_config,
        kv_cache_dtype=args.kv_cache_dtype,
        # The timed run repeats the warm-up's prompts; a cache hit would skip
        # their prefill.
        enable_prefix_caching=False,
    )
    if spec:
        kwargs.update(
            method="dspark",
            draft_model=args.draft_model,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    llm = LLMEngine(model, **kwargs)
    if args.prompts == "corpus":
        prompts = corpus_prompts(llm, args.num_prompts, args.input_len)
    else:
        vocab = int(llm.config.hf_config.text["vocab_size"])
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    params = sampling_params(args, len(prompts))
    # Warm-up on the timed batch itself: on a GPU the first run of a shape compiles
    # kernels and tunes fla's, and a smaller warm-up left that inside the timing.
    llm.generate(prompts, params)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outputs)
    stats = llm.get_spec_decode_stats()
    llm.close()
    extra = ""
    if stats:
        per_position = ", ".join(
            f"{100 * rate:.1f}" for rate in stats["per_position_acceptance"]
        )
        extra = (
            f", tok/fwd {stats['avg_tokens_per_forward']:.2f}, "
            f"acceptance {100 * stats['acceptance_rate']:.2f}% "
            f"(per position: {per_position})"
        )
    label = f"pp{pp} x tp{tp} {'dspark' if spec else 'target-only'}"
    label += " async" if run_ahead else ""
    line = f"{label}: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s"
    return line + extra, [o["token_ids"] for o in outputs]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """How many sequences' greedy ids equal the first run's, and where the others
    first differ: in fp32 every one must agree; in bf16 a verify's T + 1 rows and a
    one-row decode round differently, so near-tied tokens may flip."""
    firsts = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(tokens, reference)
        if a != b
    ]
    line = f"greedy ids {len(tokens) - len(firsts)}/{len(tokens)} identical to the first run"
    return line + (f" (first differences at tokens {sorted(firsts)})" if firsts else "")


def batch_scaling(args: argparse.Namespace, model: str) -> None:
    """Target-only tok/s at each batch size, on one in-process engine."""
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLMEngine(
        model,
        device=args.device,
        dtype=args.dtype,
        online_quant_config=args.online_quant_config,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=max(sizes),
        # Each size reuses the first prompts; a cache hit would skip their prefill.
        enable_prefix_caching=False,
    )
    vocab = int(llm.config.hf_config.text["vocab_size"])
    prompts = random_prompts(max(sizes), args.input_len, vocab, seed=0)
    params = sampling_params(args, len(prompts))
    llm.generate(prompts[:2], params[:2])  # warm-up
    print(
        f"batch scaling, pp1 x tp1 target-only, input {args.input_len}, "
        f"output {args.output_len}:"
    )
    first_rate = None
    try:
        for size in sizes:
            start = time.perf_counter()
            outputs = llm.generate(prompts[:size], params[:size])
            elapsed = time.perf_counter() - start
            tokens = sum(len(o["token_ids"]) for o in outputs)
            rate = tokens / elapsed
            first_rate = first_rate or rate
            print(
                f"batch {size:4d}: {tokens} tokens in {elapsed:.2f} s = "
                f"{rate:.1f} tok/s ({rate / first_rate:.2f}x batch {sizes[0]})",
                flush=True,
            )
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-kimi-k3")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--scaled-k3", type=int, default=0, metavar="HIDDEN")
    parser.add_argument("--layouts", default="1x1", help="comma list of PPxTP")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument(
        "--online-quant-config",
        "--online_quant_config",
        default=None,
        help='e.g. \'{"global_quant_config": "ptpc_fp8"}\' (fp8 weights)',
    )
    parser.add_argument(
        "--kv-cache-dtype",
        "--kv_cache_dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="fp8: e4m3 KV rows (docs/accuracy.md)",
    )
    parser.add_argument("--prompts", choices=["corpus", "random"], default="corpus")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (ids compared across runs); > 0: seeded sampling per prompt",
    )
    parser.add_argument(
        "--batch-sizes",
        help="comma list: measure target-only batch scaling instead of layouts",
    )
    parser.add_argument(
        "--compare-async",
        action="store_true",
        help="also run target-only with async scheduling (pp1 x tp1 only)",
    )
    args = parser.parse_args()
    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if args.scaled_k3:
            dtype = "bfloat16" if args.dtype == "auto" else args.dtype
            model = scaled_k3_checkpoint(args.scaled_k3, dtype, Path(tmp) / "k3")
        if args.batch_sizes:
            batch_scaling(args, model)
            return
        reference = None
        for layout in args.layouts.split(","):
            pp, tp = (int(x) for x in layout.split("x"))
            runs = [(False, False)]
            if args.compare_async:
                runs.append((False, True))
            if args.draft_model:
                runs.append((True, False))
            for spec, run_ahead in runs:
                line, tokens = run(args, model, tp, pp, spec, run_ahead)
                if args.temperature > 0:  # draws differ with speculation: no ids
                    print(line, flush=True)
                    continue
                reference = reference or tokens
                print(f"{line}; {agreement(tokens, reference)}", flush=True)


if __name__ == "__main__":
    main()
