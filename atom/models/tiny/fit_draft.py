"""Fit a tiny DSpark draft to its tiny target by self-distillation, deterministically.

    python -m atom.models.tiny.fit_draft --target tiny-kimi-k3 \\
        --draft tiny-kimi-k3-dspark --out atom/models/tiny/fitted/tiny-kimi-k3-dspark.safetensors

A randomly initialised draft accepts almost nothing, and a draft that accepts nothing
hides the bugs speculation is prone to: a draft on a wrong embedding, or with
unwritten context rows, still produces correct text and only loses acceptance. So
the tiny drafts ship fitted weights:

1. seeded prompts; the target's greedy continuations come from the real engine;
   seeded random sequences add cheap contexts (a prefill scores every position,
   while each greedy token costs a decode step);
2. one prefill forward of the target over each sequence gives the draft's taps and
   the target's logits at every position (the target is causal, so these equal what
   the engine sees incrementally);
3. the draft's own weights (never the shared embedding / LM head) are trained with
   seeded AdamW on DSpark's objective against the target's distributions
   (`draft_objective.dspark_loss`, T = 7);
4. held-out prompts measure greedy acceptance through the engine, before and after.

Single-threaded by default: the result then does not depend on the thread count.

What it reaches: the tiny targets are random networks whose greedy continuations
look like noise, so even their own distillation predicts only the first draft
now and then (greedy, T = 7, held-out prompts: acceptance ~0.1-0.2% -> ~1%, first
draft ~1% -> ~6.5%, tok/fwd ~1.01 -> ~1.07; sampled at temperature 1 the draft's
distribution overlaps the target's: ~26% at T = 2). That is far above chance and
collapses with a wrong embedding, which is what the tests need.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from atom.config import Config, load_hf_config
from atom.model_engine.batch import SeqWork
from atom.model_engine.cache_engine import CacheEngine
from atom.model_engine.llm_engine import LLMEngine
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_loader.loader import load_weights
from atom.model_ops.linear import MergedColumnParallelLinear
from atom.models.kimi_k3_dspark import KimiK3DSpark
from atom.models.registry import get_model_class
from atom.models.tiny.build import build_dspark_draft
from atom.models.tiny.configs import TOKEN_IDS
from atom.models.tiny.draft_objective import dspark_loss
from atom.models.utils import language_model_of
from atom.sampling_params import SamplingParams
from atom.spec_decode.aux_capture import TapCapture, allocate_tap_buffers
from atom.utils.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger("atom.fit_draft")

BLOCK_SIZE = 16
FORWARD_SEQS = 64  # sequences per tap-collection forward (bounds its memory)
# The tiny vocabularies end with the special tokens; prompts use the others.
NUM_PLAIN_TOKENS = min(TOKEN_IDS.values())


@dataclass
class Traces:
    """Sequences with the target's taps [L, n_taps * H] and final hidden [L, H]."""

    tokens: list[list[int]]
    first_anchor: list[int]  # the first row p whose block is trained
    taps: list[torch.Tensor]
    hidden: list[torch.Tensor]

    def extend(self, other: Traces) -> None:
        for name in ("tokens", "first_anchor", "taps", "hidden"):
            getattr(self, name).extend(getattr(other, name))


def random_prompts(
    count: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return [
        torch.randint(0, NUM_PLAIN_TOKENS, (n,), generator=gen).tolist()
        for n in lengths
    ]


def greedy_sequences(
    target: str, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (real engine)."""
    engine = LLMEngine(
        target,
        device="cpu",
        max_num_seqs=len(prompts),
        max_model_len=max(len(p) for p in prompts) + new_tokens + 1,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    engine.close()
    return [p + out["token_ids"] for p, out in zip(prompts, outputs)]


def load_target(target: str) -> tuple[torch.nn.Module, Config]:
    config = Config(model=target, device="cpu")
    model = get_model_class(config.hf_config.architecture)(config)
    load_weights(model, config.model)
    return model.eval(), config


@torch.inference_mode()
def trace(
    target: torch.nn.Module,
    tap_ids: list[int],
    sequences: list[list[int]],
    first_anchor: list[int],
) -> Traces:
    """Prefill every sequence once, capturing the taps and the final hidden states."""
    if len(first_anchor) != len(sequences):
        raise ValueError(
            f"{len(first_anchor)} first anchors for {len(sequences)} sequences"
        )
    base = language_model_of(target).model
    dtype = next(target.parameters()).dtype
    traces = Traces([], [], [], [])
    for start in range(0, len(sequences), FORWARD_SEQS):
        group = sequences[start : start + FORWARD_SEQS]
        lengths = [len(s) for s in group]
        buffers = allocate_tap_buffers(
            len(tap_ids), sum(lengths), base.hidden_size, "cpu", dtype
        )
        capture = TapCapture(base, dict(zip(tap_ids, buffers)))
        blocks = -(-max(lengths) // BLOCK_SIZE)
        CacheEngine(
            [target], blocks * len(group), BLOCK_SIZE, len(group), 0, "cpu", dtype
        )
        works = [
            SeqWork(i, seq, 0, list(range(i * blocks, (i + 1) * blocks)), i, True, 0,
                    0.0, -1, 1.0, None)
            for i, seq in enumerate(group)
        ]  # fmt: skip
        input_ids, positions, metadata = prepare_inputs(works, BLOCK_SIZE, "cpu")
        with set_forward_context(ForwardContext(metadata)):
            hidden = target(input_ids, positions)
        capture.remove()
        traces.tokens.extend(group)
        traces.taps.extend(torch.cat(buffers, dim=-1).split(lengths))
        traces.hidden.extend(hidden.split(lengths))
    traces.first_anchor.extend(first_anchor)
    return traces


def load_draft(draft_dir: str, target: torch.nn.Module, config: Config) -> KimiK3DSpark:
    draft = KimiK3DSpark(load_hf_config(draft_dir), config.hf_config.text)
    load_weights(draft, draft_dir)
    draft.share_with_target(language_model_of(target))
    return draft


def _batch(traces: Traces, indices: list[int], lm_head: torch.nn.Module):
    """Right-padded tokens [S, L], taps [S, L, D] and teacher logits [S, L, V]."""
    length = max(len(traces.tokens[i]) for i in indices)
    tokens = torch.zeros(len(indices), length, dtype=torch.long)
    taps = torch.zeros(len(indices), length, traces.taps[0].shape[-1])
    hidden = torch.zeros(len(indices), length, traces.hidden[0].shape[-1])
    for row, i in enumerate(indices):
        n = len(traces.tokens[i])
        tokens[row, :n] = torch.tensor(traces.tokens[i])
        taps[row, :n] = traces.taps[i]
        hidden[row, :n] = traces.hidden[i]
    with torch.no_grad():
        return tokens, taps, lm_head.compute_logits(hidden)


def train(draft: KimiK3DSpark, traces: Traces, args: argparse.Namespace) -> list[float]:
    """Seeded AdamW with cosine decay over random anchors; the loss of every step."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    # The draft's own weights: the shared embedding and LM head are not registered.
    params = list(draft.parameters())
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    width = args.num_speculative_tokens
    short = [
        i
        for i, (seq, first) in enumerate(zip(traces.tokens, traces.first_anchor))
        if len(seq) - 1 - width < first
    ]
    if short:
        raise ValueError(
            f"sequences {short[:5]} leave no anchor with T={width} rows after it"
        )
    losses = []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        indices = torch.randperm(len(traces.tokens), generator=gen)[: args.batch_seqs]
        tokens, taps, teacher = _batch(traces, indices.tolist(), draft.lm_head)
        low = torch.tensor([traces.first_anchor[i] for i in indices])
        high = torch.tensor([len(traces.tokens[i]) - 1 - width for i in indices])
        u = torch.rand(len(indices), args.anchors_per_seq, generator=gen)
        anchors = low.unsqueeze(1) + (u * (high - low + 1).unsqueeze(1)).long()
        loss = dspark_loss(draft, taps, tokens, anchors, width, teacher)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == args.steps - 1:
            logger.info("step %d loss %.4f", step, losses[-1])
    for p in params:
        p.requires_grad_(False)
    return losses


def checkpoint_tensors(draft: KimiK3DSpark) -> dict[str, torch.Tensor]:
    """The draft's own weights under checkpoint names (merged projections split)."""
    parts_of: dict[str, list[str]] = {}
    by_shard = sorted(draft.packed_modules_mapping.items(), key=lambda kv: kv[1][1])
    for part, (packed, _) in by_shard:
        parts_of.setdefault(packed, []).append(part)
    tensors = {}
    for module_name, module in draft.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            value = param.detach().float()
            if not isinstance(module, MergedColumnParallelLinear):
                tensors[full] = value.contiguous()
                continue
            packed = module_name.rsplit(".", 1)[-1]
            for part, piece in zip(parts_of[packed], value.split(module.output_sizes)):
                tensors[full.replace(f".{packed}.", f".{part}.")] = piece.contiguous()
    return tensors


def greedy_acceptance(
    target: str, draft_dir: str, prompts: list[list[int]], new_tokens: int, width: int
) -> dict:
    engine = LLMEngine(
        target,
        device="cpu",
        max_num_seqs=len(prompts),
        max_model_len=max(len(p) for p in prompts) + new_tokens + 1,
        method="dspark",
        draft_model=draft_dir,
        num_speculative_tokens=width,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, params)
    stats = engine.get_mtp_statistics()
    engine.close()
    return stats


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="tiny target name")
    parser.add_argument("--draft", required=True, help="tiny draft name to fit")
    parser.add_argument("--out", required=True, help="output .safetensors path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--greedy-prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--random-sequences", type=int, default=1024)
    parser.add_argument("--random-length", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-seqs", type=int, default=16)
    parser.add_argument("--anchors-per-seq", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    prompts = random_prompts(args.greedy_prompts, 8, 32, args.seed)
    contexts = random_prompts(
        args.random_sequences, args.random_length, args.random_length, args.seed + 1
    )
    held_out = random_prompts(args.eval_prompts, 8, 32, args.seed + 2)
    greedy = greedy_sequences(args.target, prompts, args.new_tokens)
    logger.info("greedy continuations after %.0f s", time.monotonic() - started)
    target, config = load_target(args.target)
    with tempfile.TemporaryDirectory() as tmp:
        initial_dir, fitted_dir = f"{tmp}/initial", f"{tmp}/fitted"
        build_dspark_draft(args.draft, initial_dir, fitted=None)
        draft = load_draft(initial_dir, target, config)
        taps = list(draft.tap_ids)
        # Greedy sequences train from their first generated anchor on.
        traces = trace(target, taps, greedy, [len(p) - 1 for p in prompts])
        traces.extend(trace(target, taps, contexts, [0] * len(contexts)))
        logger.info("traces after %.0f s", time.monotonic() - started)
        losses = train(draft, traces, args)
        tensors = checkpoint_tensors(draft)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, args.out, metadata={"format": "pt"})
        build_dspark_draft(args.draft, fitted_dir, fitted=tensors)
        width, new = args.num_speculative_tokens, args.new_tokens
        before = greedy_acceptance(args.target, initial_dir, held_out, new, width)
        after = greedy_acceptance(args.target, fitted_dir, held_out, new, width)
    window = min(20, len(losses))
    logger.info(
        "loss: first %.3f, mean of first %d %.3f, of last %d %.3f, final %.3f",
        losses[0], window, sum(losses[:window]) / window, window,
        sum(losses[-window:]) / window, losses[-1],
    )  # fmt: skip
    for label, stats in (("before", before), ("after", after)):
        logger.info(
            "%s fitting (T=%d, greedy, %d held-out prompts): acceptance %.2f%% "
            "(%d/%d), %.3f tok/fwd, per position %s",
            label,
            width,
            len(held_out),
            100 * stats["acceptance_rate"],
            stats["total_accepted_tokens"],
            stats["total_draft_tokens"],
            stats["avg_tokens_per_forward"],
            [round(r, 3) for r in stats["per_position_acceptance"]],
        )
    logger.info("wrote %s after %.0f s", args.out, time.monotonic() - started)


if __name__ == "__main__":
    main()
