"""What online quantization and an fp8 KV cache cost the trained tiny models:
held-out perplexity, greedy agreement with the model-dtype run, and DSpark
acceptance, per setting.

Each setting is a model dtype, an optional `--online_quant_config` and a
`--kv-cache-dtype` (every setting named by `--settings` runs at each KV dtype
given). Perplexity is
`tools/train_target.perplexity` over the shipped held-out excerpt (the stream
`tools/train_tiny.py` evaluates on); agreement and acceptance run through the engine on
the held-out prompts `benchmarks/bench_offline.py` uses. Each setting's greedy ids
are compared with those of every setting before it.

    python -m tools.quant_accuracy --draft-model tiny-kimi-k3-dspark
    python -m tools.quant_accuracy --draft-model tiny-kimi-k3-dspark \
        --settings bf16 "ptpc_fp8, bf16" --kv-cache-dtype auto fp8
    # the same on a GPU, and again with every kernel on its torch reference:
    python -m tools.quant_accuracy --device cuda --draft-model tiny-kimi-k3-dspark \
        --settings bf16 "ptpc_fp8, bf16" --kv-cache-dtype auto fp8
    ATOM_DISABLE_TRITON=1 python -m tools.quant_accuracy --device cuda ...
"""

from __future__ import annotations

import argparse
import json

import torch
from tokenizers import Tokenizer

from atom import LLMEngine, SamplingParams
from atom.config import KV_CACHE_DTYPES, Config
from atom.model_loader.build import load_target
from atom.model_ops.paged_cache import resolve_kv_cache_dtype
from atom.models.tiny.configs import TOKEN_IDS
from atom.models.tiny.excerpt import HELD_OUT_FILE, held_out_prompt_ids
from atom.models.tiny.tokenizer import TOKENIZER_FILE
from tools.train_target import perplexity, token_stream

PTPC_FP8 = '{"global_quant_config": "ptpc_fp8"}'
# (label, model dtype, online config)
SETTINGS = (
    ("fp32", "float32", None),
    ("bf16", "bfloat16", None),
    ("ptpc_fp8, bf16", "bfloat16", PTPC_FP8),
    ("ptpc_fp8, fp32", "float32", PTPC_FP8),
)


def held_out_stream(tokenizer: Tokenizer) -> torch.Tensor:
    """The excerpt's chapters as `train_tiny` streams them: verses joined by spaces,
    each chapter followed by eos."""
    chapters = HELD_OUT_FILE.read_text(encoding="utf-8").strip().split("\n\n")
    texts = [" ".join(chapter.splitlines()) for chapter in chapters]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return token_stream(encode, texts, TOKEN_IDS["eos_token_id"])


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def measure(
    args: argparse.Namespace, dtype: str, online: str | None, kv_dtype: str
) -> dict:
    config = Config(
        model=args.model,
        device=args.device,
        dtype=dtype,
        online_quant_config=online,
        kv_cache_dtype=kv_dtype,
    )
    model, _ = load_target(config, args.device)
    tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))
    with torch.no_grad():
        ppl = perplexity(
            model,
            held_out_stream(tokenizer),
            args.ppl_seq_len,
            resolve_kv_cache_dtype(kv_dtype, args.device),
        )
    del model
    prompts = held_out_prompt_ids(args.num_prompts, args.input_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine_kwargs = dict(
        device=args.device,
        dtype=dtype,
        online_quant_config=online,
        kv_cache_dtype=kv_dtype,
        max_num_seqs=args.num_prompts,
    )
    result: dict = {"held_out_perplexity": ppl}
    engine = LLMEngine(args.model, **engine_kwargs)
    result["ids"] = [o["token_ids"] for o in engine.generate(prompts, params)]
    engine.close()
    if args.draft_model:
        engine = LLMEngine(
            args.model,
            method="dspark",
            draft_model=args.draft_model,
            num_speculative_tokens=args.num_speculative_tokens,
            **engine_kwargs,
        )
        ids = [o["token_ids"] for o in engine.generate(prompts, params)]
        stats = engine.get_spec_decode_stats()
        engine.close()
        result["dspark"] = {
            "acceptance_rate": stats["acceptance_rate"],
            "avg_tokens_per_forward": stats["avg_tokens_per_forward"],
            "per_position_acceptance": stats["per_position_acceptance"],
            "ids_equal_target_only": ids == result["ids"],
        }
    return result


def agreement(ids: list[list[int]], reference: list[list[int]]) -> dict:
    """Sequences identical to the reference, where the others first differ, and the
    share of positions whose token equals the reference's."""
    firsts = [first_difference(a, b) for a, b in zip(ids, reference)]
    same = sum(x == y for a, b in zip(ids, reference) for x, y in zip(a, b))
    total = sum(len(b) for b in reference)
    return {
        "identical_sequences": sum(f is None for f in firsts),
        "sequences": len(ids),
        "first_differences": sorted(f for f in firsts if f is not None),
        "positionwise_agreement": same / total,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-kimi-k3")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--ppl-seq-len", type=int, default=256)
    labels = [label for label, _, _ in SETTINGS]
    parser.add_argument(
        "--settings", nargs="+", choices=labels, default=labels, metavar="LABEL"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=KV_CACHE_DTYPES,
        default=["auto"],
        help="KV cache dtypes to run every setting at",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda (on CUDA the fp8 GEMMs, Triton kernels and graphs run; "
        "ATOM_DISABLE_TRITON=1 sends every kernel to its torch reference)",
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: keep)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report, ids = {}, {}
    runs = [
        (label if kv == "auto" else f"{label}, {kv} KV", dtype, online, kv)
        for label, dtype, online in SETTINGS
        if label in args.settings
        for kv in args.kv_cache_dtype
    ]
    for label, dtype, online, kv in runs:
        result = measure(args, dtype, online, kv)
        ids[label] = result.pop("ids")
        for earlier in list(ids)[:-1]:
            result[f"greedy_vs_{earlier}"] = agreement(ids[label], ids[earlier])
        report[label] = result
        print(label, json.dumps(result), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
