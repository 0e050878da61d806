"""Distil a tiny DSpark draft from its trained target, deterministically.

1. Sequences the draft should follow: corpus prompts with the target's greedy and
   sampled continuations (from the real engine), and plain corpus windows.
2. One prefill of the target over each sequence gives the draft's taps and the
   target's final hidden states at every position (the target is causal, so these
   equal what the engine sees incrementally).
3. The draft's own weights (never the shared embedding / LM head) are trained with
   seeded AdamW on DSpark's objective against the target's distributions
   (`draft_objective.dspark_loss`, T = 7), from random anchors.
4. Held-out prompts measure acceptance through the engine (`engine_acceptance`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from atom.config import Config, load_hf_config
from atom.model_engine.llm_engine import LLMEngine
from atom.model_loader.loader import load_weights
from atom.models.dspark_base import DSparkDraft
from atom.models.registry import draft_architecture, get_draft_model_class
from atom.models.utils import language_model_of
from atom.sampling_params import SamplingParams
from atom.spec_decode.aux_capture import TapCapture, allocate_tap_buffers
from atom.utils.arithmetic import ceil_div
from tools.draft_objective import dspark_loss
from tools.prefill import BLOCK_SIZE, prefill
from tools.step_plan import StepPlan, run_steps

FORWARD_SEQS = 32  # sequences per tap-collection forward (bounds its memory)
MAX_ENGINE_SEQS = 128  # sequences one engine step may batch


@dataclass(frozen=True)
class DraftSettings:
    prompts: int  # corpus prompts continued by the target (greedy, then sampled)
    prompt_len: tuple[int, int]  # min, max prompt tokens
    new_tokens: int
    sample_temperature: float
    corpus_windows: int
    window_len: int
    steps: int
    batch_seqs: int
    anchors_per_seq: int
    lr: float
    num_speculative_tokens: int = 7
    warmup_steps: int = 20
    seconds: float = 0.0  # time budget; 0: exactly `steps`, else at most `steps`


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


def _engine_size(num_prompts: int, max_len: int) -> dict:
    """Engine limits for a batch: KV blocks for every sequence at once, no more (on
    a GPU the default would reserve most of the memory training needs)."""
    seqs = min(num_prompts, MAX_ENGINE_SEQS)
    blocks = seqs * ceil_div(max_len, BLOCK_SIZE) + 1
    return dict(max_num_seqs=seqs, max_model_len=max_len, num_kvcache_blocks=blocks)


def continuations(
    target: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    device: str,
) -> list[list[int]]:
    """Each prompt followed by the target's continuation (real engine)."""
    max_len = max(len(p) for p in prompts) + max(p.max_tokens for p in params)
    engine = LLMEngine(target, device=device, **_engine_size(len(prompts), max_len))
    try:
        outputs = engine.generate(prompts, params)
    finally:
        engine.close()
    return [p + out["token_ids"] for p, out in zip(prompts, outputs)]


@torch.inference_mode()
def trace(
    target: nn.Module,
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
    parameter = next(target.parameters())
    traces = Traces([], [], [], [])
    for start in range(0, len(sequences), FORWARD_SEQS):
        group = sequences[start : start + FORWARD_SEQS]
        lengths = [len(s) for s in group]
        buffers = allocate_tap_buffers(
            len(tap_ids),
            sum(lengths),
            base.hidden_size,
            parameter.device,
            parameter.dtype,
        )
        capture = TapCapture(base, dict(zip(tap_ids, buffers)))
        try:
            hidden = prefill(target, group)
        finally:
            capture.remove()
        traces.tokens.extend(group)
        traces.taps.extend(torch.cat(buffers, dim=-1).split(lengths))
        traces.hidden.extend(hidden.split(lengths))
    traces.first_anchor.extend(first_anchor)
    return traces


def load_draft(draft_dir: str, target: nn.Module, config: Config) -> DSparkDraft:
    """The draft of `draft_dir` (its registry class) on the target's device, bound
    to the target's table and head."""
    device = next(target.parameters()).device
    draft_config = load_hf_config(draft_dir)
    draft_class = get_draft_model_class(draft_architecture(draft_config))
    with device:
        draft = draft_class(draft_config, config.hf_config.text)
    load_weights(draft, draft_dir)
    draft.share_with_target(language_model_of(target))
    return draft


def _batch(traces: Traces, indices: list[int], lm_head: nn.Module):
    """Right-padded tokens [S, L], taps [S, L, D] and teacher logits [S, L, V]."""
    device = traces.taps[0].device
    length = max(len(traces.tokens[i]) for i in indices)
    tokens = torch.zeros(len(indices), length, dtype=torch.long, device=device)
    taps = torch.zeros(len(indices), length, traces.taps[0].shape[-1], device=device)
    hidden = torch.zeros(
        len(indices), length, traces.hidden[0].shape[-1], device=device
    )
    for row, i in enumerate(indices):
        n = len(traces.tokens[i])
        tokens[row, :n] = torch.tensor(traces.tokens[i], device=device)
        taps[row, :n] = traces.taps[i]
        hidden[row, :n] = traces.hidden[i]
    with torch.no_grad():
        return tokens, taps, lm_head.compute_logits(hidden)


def train(
    draft: DSparkDraft,
    traces: Traces,
    settings: DraftSettings,
    seed: int,
    progress: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Seeded AdamW, warm-up then cosine decay, over random anchors; every loss.
    `progress(step, total, loss)`."""
    gen = torch.Generator().manual_seed(seed)
    plan = StepPlan(settings.steps, settings.seconds, settings.warmup_steps)
    # The draft's own weights: the shared embedding and LM head are not registered.
    params = list(draft.parameters())
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    width = settings.num_speculative_tokens
    short = [
        i
        for i, (seq, first) in enumerate(zip(traces.tokens, traces.first_anchor))
        if len(seq) - 1 - width < first
    ]
    if short:
        raise ValueError(
            f"sequences {short[:5]} leave no anchor with T={width} rows after it"
        )
    device = traces.taps[0].device

    def learning_rate(step: int, total: int) -> float:
        warm = min(1.0, (step + 1) / settings.warmup_steps)
        decay = 0.5 * (1 + math.cos(math.pi * step / total))
        return settings.lr * warm * decay

    def step_loss(step: int) -> torch.Tensor:
        indices = torch.randperm(len(traces.tokens), generator=gen)
        indices = indices[: settings.batch_seqs].tolist()
        tokens, taps, teacher = _batch(traces, indices, draft.lm_head)
        low = torch.tensor([traces.first_anchor[i] for i in indices])
        high = torch.tensor([len(traces.tokens[i]) - 1 - width for i in indices])
        u = torch.rand(len(indices), settings.anchors_per_seq, generator=gen)
        anchors = low.unsqueeze(1) + (u * (high - low + 1).unsqueeze(1)).long()
        return dspark_loss(draft, taps, tokens, anchors.to(device), width, teacher)

    try:
        return run_steps(
            plan, optimizer, learning_rate, step_loss, 1.0, progress=progress
        )
    finally:
        for p in params:
            p.requires_grad_(False)


def collect_traces(
    target_dir: str,
    target: nn.Module,
    tap_ids: list[int],
    stream: torch.Tensor,
    settings: DraftSettings,
    seed: int,
    device: str,
) -> Traces:
    """Greedy and sampled continuations of corpus prompts, plus corpus windows."""
    gen = torch.Generator().manual_seed(seed)
    low, high = settings.prompt_len
    lengths = torch.randint(low, high + 1, (2 * settings.prompts,), generator=gen)
    starts = torch.randint(
        0, stream.numel() - high, (2 * settings.prompts,), generator=gen
    )
    prompts = [
        stream[s : s + n].tolist() for s, n in zip(starts.tolist(), lengths.tolist())
    ]
    greedy = SamplingParams(
        temperature=0.0, max_tokens=settings.new_tokens, ignore_eos=True
    )
    sampled = [
        SamplingParams(
            temperature=settings.sample_temperature,
            max_tokens=settings.new_tokens,
            ignore_eos=True,
            seed=seed + i,
        )
        for i in range(settings.prompts)
    ]
    params = [greedy] * settings.prompts + sampled
    sequences = continuations(target_dir, prompts, params, device)
    windows = [
        stream[s : s + settings.window_len].tolist()
        for s in torch.randint(
            0,
            stream.numel() - settings.window_len,
            (settings.corpus_windows,),
            generator=gen,
        ).tolist()
    ]
    # Continuations train from their first generated anchor on, windows throughout.
    traces = trace(target, tap_ids, sequences, [len(p) - 1 for p in prompts])
    if windows:
        traces.extend(trace(target, tap_ids, windows, [0] * len(windows)))
    return traces


def engine_acceptance(
    target: str,
    draft_dir: str,
    prompts: list[list[int]],
    new_tokens: int,
    width: int,
    device: str,
    temperature: float = 0.0,
    **layout,
) -> dict:
    """Speculation statistics of one engine run over `prompts` (eos ignored)."""
    max_len = max(len(p) for p in prompts) + new_tokens + width + 1
    engine = LLMEngine(
        target,
        device=device,
        **_engine_size(len(prompts), max_len),
        method="dspark",
        draft_model=draft_dir,
        num_speculative_tokens=width,
        **layout,
    )
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=i
        )
        for i in range(len(prompts))
    ]
    try:
        engine.generate(prompts, params)
        return engine.get_spec_decode_stats()
    finally:
        engine.close()
