"""Train the built-in tiny models: the K3 target, the Kimi Linear target, then the
DSpark draft distilled from the trained K3 target.

    python -m tools.train_tiny --config h200 --seed 0 --out OUT \\
        [--corpus-deb bible-kjv-text_4.38_all.deb] [--device auto]

OUT receives `tiny-kimi-k3.safetensors`, `tiny-kimi-linear.safetensors` and
`tiny-kimi-k3-dspark.safetensors` (bf16, checkpoint names; copy them to
`atom/models/tiny/trained/` to ship them) and `report.json`: losses, held-out
perplexities and the draft's acceptance through the engine (a run of some stages
keeps the other stages' entries of an existing report). Each model is
evaluated as shipped, i.e. after rounding to bf16, and the draft is distilled
against the rounded target. `--stages draft` redoes only the distillation, against
OUT's K3 target if present, else the shipped one. See docs/tiny_models.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from atom.models.tiny import build
from atom.models.tiny.configs import TOKEN_IDS
from atom.models.tiny.tokenizer import TOKENIZER_FILE
from tools import fit_draft
from tools.corpus import load_corpus, load_excerpt
from tools.export import export_checkpoint
from tools.prefill import load_model, pick_device
from tools.train_config import PRESETS, TrainConfig, with_overrides
from tools.train_target import perplexity, token_stream, train_target

logger = logging.getLogger("atom.train_tiny")

STAGES = ("k3", "linear", "draft")
K3_ARCH = "KimiK3ForConditionalGeneration"
K3, LINEAR, DRAFT = "tiny-kimi-k3", "tiny-kimi-linear", "tiny-kimi-k3-dspark"


def _bar(total: int, label: str):
    """A tqdm bar and the progress callback that advances it with the loss (a time
    budget may shorten the run after calibration)."""
    bar = tqdm(total=total, desc=label, unit="step", dynamic_ncols=True)

    def progress(step: int, steps: int, loss: float) -> None:
        bar.total = steps
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    return bar, progress


def _rounded(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ships: bf16."""
    return {name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})


def _loss_summary(losses: list[float]) -> dict:
    window = max(1, min(50, len(losses) // 10))
    return {
        "steps": len(losses),
        "first": losses[0],
        "mean_of_last": sum(losses[-window:]) / window,
        "last_window": window,
    }


def _write_target(name: str, folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    if name == K3:
        build.write_k3_layout(folder, K3_ARCH, tensors)
    else:
        build.write_kimi_linear(folder, tensors)


def train_target_stage(
    name: str, config: TrainConfig, streams: dict, args, tmp: Path
) -> dict:
    settings = config.k3 if name == K3 else config.linear
    device = pick_device(args.device)
    initial = build.initial_tensors(name)
    _write_target(name, tmp / f"{name}-initial", initial)
    model, _ = load_model(str(tmp / f"{name}-initial"), device)
    started = time.monotonic()
    bar, progress = _bar(settings.steps, name)
    losses = train_target(model, streams["train"], settings, args.seed, progress)
    bar.close()
    seconds = time.monotonic() - started
    shipped = _rounded(export_checkpoint(model, initial))
    _save(shipped, args.out / f"{name}.safetensors")
    # Evaluate what ships: the rounded weights through a freshly built folder.
    _write_target(name, tmp / name, shipped)
    rounded, _ = load_model(str(tmp / name), device)
    ppl = perplexity(rounded, streams["held_out"], config.eval.ppl_seq_len)
    tokens = len(losses) * settings.seqs_per_step * settings.seq_len
    result = {
        "loss": _loss_summary(losses),
        "held_out_perplexity": ppl,
        "train_perplexity_sample": perplexity(
            rounded,
            streams["train"][: streams["held_out"].numel()],
            config.eval.ppl_seq_len,
        ),
        "seconds": seconds,
        "tokens_seen": tokens,
        "steps_per_second": len(losses) / seconds,
        "tokens_per_second": tokens / seconds,
    }
    logger.info("%s: %s", name, json.dumps(result))
    return result


def _held_out_prompts(stream: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """`count` evenly spaced windows of the held-out stream."""
    stride = (stream.numel() - length) // count
    return [stream[i * stride : i * stride + length].tolist() for i in range(count)]


def draft_stage(config: TrainConfig, streams: dict, args, tmp: Path) -> dict:
    settings, evals = config.draft, config.eval
    device = pick_device(args.device)
    fresh = args.out / f"{K3}.safetensors"
    target_tensors = (
        {k: v.float() for k, v in load_file(str(fresh)).items()}
        if fresh.is_file()
        else build.trained_tensors(K3)
    )
    target_dir = tmp / "draft-target"
    build.write_k3_layout(target_dir, K3_ARCH, target_tensors)
    target, target_config = load_model(str(target_dir), device)
    initial = build.initial_tensors(DRAFT)
    build.write_dspark_draft(tmp / "draft-initial", initial, None)
    draft = fit_draft.load_draft(str(tmp / "draft-initial"), target, target_config)
    started = time.monotonic()
    traces = fit_draft.collect_traces(
        str(target_dir), target, list(draft.tap_ids), streams["train"], settings,
        args.seed, device.type,
    )  # fmt: skip
    trace_seconds = time.monotonic() - started
    bar, progress = _bar(settings.steps, DRAFT)
    losses = fit_draft.train(draft, traces, settings, args.seed + 1, progress)
    bar.close()
    train_seconds = time.monotonic() - started - trace_seconds
    shipped = _rounded(export_checkpoint(draft, initial))
    _save(shipped, args.out / f"{DRAFT}.safetensors")
    del traces, draft, target
    draft_dir = tmp / "draft"
    build.write_dspark_draft(draft_dir, shipped, None)
    prompts = _held_out_prompts(streams["held_out"], evals.prompts, evals.prompt_len)
    width = settings.num_speculative_tokens
    acceptance = {}
    for label, temperature in (("greedy", 0.0), ("sampled", evals.sample_temperature)):
        stats = fit_draft.engine_acceptance(
            str(target_dir), str(draft_dir), prompts, evals.new_tokens, width,
            device.type, temperature,
        )  # fmt: skip
        acceptance[label] = {
            "temperature": temperature,
            "acceptance_rate": stats["acceptance_rate"],
            "avg_tokens_per_forward": stats["avg_tokens_per_forward"],
            "per_position_acceptance": stats["per_position_acceptance"],
        }
    result = {
        "loss": _loss_summary(losses),
        "trace_seconds": trace_seconds,
        "train_seconds": train_seconds,
        "sequences": 2 * settings.prompts + settings.corpus_windows,
        "acceptance": acceptance,
        "eval": {"prompts": evals.prompts, "prompt_len": evals.prompt_len,
                 "new_tokens": evals.new_tokens, "k": width},
    }  # fmt: skip
    logger.info("%s: %s", DRAFT, json.dumps(result))
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--set", action="append", default=[], metavar="STAGE.FIELD=V")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    corpus = parser.add_mutually_exclusive_group()
    corpus.add_argument("--corpus-deb", help="bible-kjv-text .deb (default: apt-get)")
    corpus.add_argument(
        "--corpus-excerpt", help="train on an excerpt-format file instead (quick runs)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: keep)")
    args = parser.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = with_overrides(PRESETS[args.config], args.set)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.corpus_excerpt:
        corpus = load_excerpt(args.corpus_excerpt)
    else:
        corpus = load_corpus(args.corpus_deb)
    tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    eos = TOKEN_IDS["eos_token_id"]
    streams = {
        "train": token_stream(encode, [c.text for c in corpus.train], eos),
        "held_out": token_stream(encode, [c.text for c in corpus.held_out], eos),
    }
    report: dict = {
        "config": args.config,
        "overrides": args.set,
        "seed": args.seed,
        "device": str(pick_device(args.device)),
        "corpus_tokens": {k: v.numel() for k, v in streams.items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for stage, name in (("k3", K3), ("linear", LINEAR)):
            if stage in args.stages:
                report[name] = train_target_stage(
                    name, config, streams, args, Path(tmp)
                )
        if "draft" in args.stages:
            report[DRAFT] = draft_stage(config, streams, args, Path(tmp))
    report["seconds"] = time.monotonic() - started
    # A run of some stages keeps what an earlier run reported for the others.
    path = args.out / "report.json"
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    kept = {name: earlier[name] for name in (K3, LINEAR, DRAFT) if name in earlier}
    report = {**kept, **report}
    path.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s after %.0f s", args.out, report["seconds"])
    return report


if __name__ == "__main__":
    main()
