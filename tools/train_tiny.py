"""Train the built-in tiny models of one family: its targets, then the DSpark draft
distilled from one of them (`tools/tiny_family.py`). The preset names the family:
Kimi (`cpu`, `h200`, `smoke`) trains the K3 and Kimi Linear targets and the K3
draft, MiniMax (`minimax-cpu`, `minimax-smoke`) the M3 target and its draft.

    python -m tools.train_tiny --config h200 --seed 0 --out OUT \\
        [--corpus-deb bible-kjv-text_4.38_all.deb] [--device auto]

OUT receives one `<name>.safetensors` per trained file (bf16, checkpoint names; copy
them to `atom/models/tiny/trained/` to ship them) and `report.json`: losses,
held-out perplexities and the draft's acceptance through the engine (a run of some
stages keeps the other stages' entries of an existing report). Each model is
evaluated as shipped, i.e. after rounding to bf16, and the draft is distilled
against the rounded target. `--stages draft` redoes only the distillation, against
OUT's target if present, else the shipped one. See docs/tiny_models.md.
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

from atom.models.tiny import trained
from atom.models.tiny.configs import TOKEN_IDS
from atom.models.tiny.tokenizer import TOKENIZER_FILE
from tools import fit_draft
from tools.corpus import load_corpus, load_excerpt
from tools.export import export_checkpoint
from tools.indexer_objective import mean_kept_mass
from tools.prefill import load_model, pick_device
from tools.tiny_family import FAMILIES, Family
from tools.train_config import PRESETS, TrainConfig, with_overrides
from tools.train_target import perplexity, token_stream, train_target

logger = logging.getLogger("atom.train_tiny")


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


def train_target_stage(
    stage: str, config: TrainConfig, streams: dict, args, tmp: Path
) -> dict:
    settings = config.targets[stage]
    target = FAMILIES[config.family].targets[stage]
    name = target.name
    device = pick_device(args.device)
    initial = trained.initial_tensors(name)
    target.write(tmp / f"{name}-initial", initial)
    model, _ = load_model(str(tmp / f"{name}-initial"), device)
    # How much of the dense attention the kept blocks hold, on held-out windows.
    probe = _held_out_prompts(streams["held_out"], 16, config.eval.ppl_seq_len)
    initial_kept = mean_kept_mass(model, probe)
    started = time.monotonic()
    bar, progress = _bar(settings.steps, name)
    run = train_target(model, streams["train"], settings, args.seed, progress)
    losses = run.next_token
    bar.close()
    seconds = time.monotonic() - started
    shipped = _rounded(export_checkpoint(model, initial))
    _save(shipped, args.out / f"{name}.safetensors")
    # Evaluate what ships: the rounded weights through a freshly built folder.
    target.write(tmp / name, shipped)
    rounded, _ = load_model(str(tmp / name), device)
    ppl = perplexity(rounded, streams["held_out"], config.eval.ppl_seq_len)
    kept = mean_kept_mass(rounded, probe)
    tokens = len(losses) * settings.seqs_per_step * settings.seq_len
    result = {
        "loss": _loss_summary(losses),
        **(
            {
                "indexer_loss": _loss_summary(run.indexer),
                "kept_attention_mass": {"initial": initial_kept, "trained": kept},
            }
            if run.indexer
            else {}
        ),
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
    family = FAMILIES[config.family]
    teacher = family.targets[family.draft_target]
    device = pick_device(args.device)
    fresh = args.out / f"{teacher.name}.safetensors"
    target_tensors = (
        {k: v.float() for k, v in load_file(str(fresh)).items()}
        if fresh.is_file()
        else trained.trained_tensors(teacher.name)
    )
    target_dir = tmp / "draft-target"
    teacher.write(target_dir, target_tensors)
    target, target_config = load_model(str(target_dir), device)
    initial = trained.initial_tensors(family.draft)
    family.write_draft(tmp / "draft-initial", initial)
    draft = fit_draft.load_draft(str(tmp / "draft-initial"), target, target_config)
    started = time.monotonic()
    traces = fit_draft.collect_traces(
        str(target_dir), target, list(draft.tap_ids), streams["train"], settings,
        args.seed, device.type,
    )  # fmt: skip
    trace_seconds = time.monotonic() - started
    bar, progress = _bar(settings.steps, family.draft)
    losses = fit_draft.train(draft, traces, settings, args.seed + 1, progress)
    bar.close()
    train_seconds = time.monotonic() - started - trace_seconds
    shipped = _rounded(export_checkpoint(draft, initial))
    _save(shipped, args.out / f"{family.draft}.safetensors")
    del traces, draft, target
    draft_dir = tmp / "draft"
    family.write_draft(draft_dir, shipped)
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
    logger.info("%s: %s", family.draft, json.dumps(result))
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
    parser.add_argument(
        "--stages", default="", help="comma-separated (default: all of the family's)"
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: keep)")
    args = parser.parse_args(argv)
    family = FAMILIES[PRESETS[args.config].family]
    args.stages = [s for s in args.stages.split(",") if s] or list(family.stages)
    unknown = sorted(set(args.stages) - set(family.stages))
    if unknown:
        parser.error(
            f"unknown stages {unknown} for preset {args.config!r}; choose from "
            f"{', '.join(family.stages)}"
        )
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
    family: Family = FAMILIES[config.family]
    report: dict = {
        "config": args.config,
        "family": config.family,
        "overrides": args.set,
        "seed": args.seed,
        "device": str(pick_device(args.device)),
        "corpus_tokens": {k: v.numel() for k, v in streams.items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for stage, target in family.targets.items():
            if stage in args.stages:
                report[target.name] = train_target_stage(
                    stage, config, streams, args, Path(tmp)
                )
        if "draft" in args.stages:
            report[family.draft] = draft_stage(config, streams, args, Path(tmp))
    report["seconds"] = time.monotonic() - started
    # A run of some stages keeps what an earlier run reported for the others.
    path = args.out / "report.json"
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    kept = {name: earlier[name] for name in family.trained_files if name in earlier}
    report = {**kept, **report}
    path.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s after %.0f s", args.out, report["seconds"])
    return report


if __name__ == "__main__":
    main()
