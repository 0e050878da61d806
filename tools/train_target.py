"""Train a tiny target as a language model on the corpus: next-token cross-entropy.

Batches are random windows of the training token stream (chapters, each followed
by eos), drawn from a seeded generator; `seconds` > 0 bounds the run by time
(`tools.step_plan`). AdamW with linear warm-up and cosine decay
trains every parameter but the routers' correction biases, which carry no gradient
(they only pick experts): after each step they move against the measured load,
by `bias_update_rate` times its sign, so that the experts share the tokens.
Block-sparse layers' lightning indexers learn from the dense attention alongside
(`tools/indexer_objective.py`, weight `indexer_loss_weight`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops.routed_experts import FusedExperts
from tools.indexer_objective import SparseLayerHooks, indexer_loss
from tools.prefill import prefill
from tools.step_plan import StepPlan, run_steps

EVAL_WINDOWS_PER_FORWARD = 16


@dataclass(frozen=True)
class TargetSettings:
    steps: int
    seqs_per_step: int
    seq_len: int
    lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    bias_update_rate: float = 1e-3
    grad_clip: float = 1.0
    indexer_loss_weight: float = 1.0
    seconds: float = 0.0  # time budget; 0: exactly `steps`, else at most `steps`


@dataclass
class TargetLosses:
    """Every step's losses: next-token, and the indexers' (empty without sparse
    layers)."""

    next_token: list[float]
    indexer: list[float]


def token_stream(encode: Callable[[str], list[int]], texts: list[str], eos: int):
    """All texts as one 1-D LongTensor, each text followed by `eos`."""
    ids: list[int] = []
    for text in texts:
        ids.extend(encode(text))
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(
    stream: torch.Tensor, count: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """[count, length] windows of `stream` at seeded random offsets."""
    if stream.numel() <= length:
        raise ValueError(
            f"a stream of {stream.numel()} tokens has no window of {length}"
        )
    starts = torch.randint(0, stream.numel() - length, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def next_token_loss(
    model: nn.Module, windows: torch.Tensor, kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Mean cross-entropy of predicting windows[:, 1:] from windows[:, :-1]
    (`kv_dtype`: as `tools.prefill.prefill` takes it)."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    hidden = prefill(model, inputs.tolist(), kv_dtype)
    logits = model.compute_logits(hidden).float()
    return F.cross_entropy(logits, targets.reshape(-1).to(logits.device))


class ExpertBalancer:
    """Counts the tokens each routed expert receives and nudges the routers'
    correction biases towards an even load (auxiliary-loss-free balancing)."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        self.rate = rate
        # Every routed MoE block (Kimi's, MiniMax's): a router gate with a
        # correction bias beside its fused experts.
        self.moes = [
            m
            for m in model.modules()
            if isinstance(getattr(m, "experts", None), FusedExperts)
            and hasattr(getattr(m, "gate", None), "e_score_correction_bias")
        ]
        self.loads = [torch.zeros(m.experts.num_experts) for m in self.moes]
        self.handles = [
            moe.experts.register_forward_pre_hook(self._counter(i))
            for i, moe in enumerate(self.moes)
        ]

    def _counter(self, index: int):
        def count(module: nn.Module, args: tuple) -> None:
            expert_ids = args[1].ids  # FusedExperts.forward(x, choice, ...)
            counts = torch.bincount(expert_ids.flatten(), minlength=module.num_experts)
            self.loads[index] += counts.cpu().float()

        return count

    @torch.no_grad()
    def step(self) -> float:
        """Apply the bias updates; returns the worst max/mean load of this step."""
        worst = 1.0
        for moe, load in zip(self.moes, self.loads):
            if load.sum() > 0:
                worst = max(worst, float(load.max() / load.mean()))
                bias = moe.gate.e_score_correction_bias
                bias += self.rate * torch.sign(load.mean() - load).to(bias.device)
            load.zero_()
        return worst

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _optimizer(model: nn.Module, settings: TargetSettings) -> torch.optim.AdamW:
    trained = [
        (name, p)
        for name, p in model.named_parameters()
        if not name.endswith("e_score_correction_bias")
    ]
    for _, p in trained:
        p.requires_grad_(True)
    # Matrices decay; norms, gates' biases and per-channel vectors do not.
    decayed = [p for _, p in trained if p.dim() >= 2]
    plain = [p for _, p in trained if p.dim() < 2]
    groups = [
        {"params": decayed, "weight_decay": settings.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95))


def learning_rate(settings: TargetSettings, step: int, total: int) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    span = max(1, total - settings.warmup_steps)
    progress = (step - settings.warmup_steps) / span
    floor = settings.min_lr_ratio
    return settings.lr * (
        floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def train_target(
    model: nn.Module,
    stream: torch.Tensor,
    settings: TargetSettings,
    seed: int,
    progress: Callable[[int, int, float], None] | None = None,
) -> TargetLosses:
    """Train `model` in place; every step's losses (their count is the number of
    steps run). Parameters end frozen. `progress(step, total, next-token loss)`."""
    generator = torch.Generator().manual_seed(seed)
    plan = StepPlan(settings.steps, settings.seconds, settings.warmup_steps)
    optimizer = _optimizer(model, settings)
    balancer = ExpertBalancer(model, settings.bias_update_rate)
    indexers = SparseLayerHooks(model, indexer_loss)
    losses = TargetLosses([], [])

    def step_loss(step: int) -> torch.Tensor:
        windows = random_windows(
            stream, settings.seqs_per_step, settings.seq_len + 1, generator
        )
        loss = next_token_loss(model, windows)
        losses.next_token.append(loss.item())
        indexer = indexers.take()
        if indexer is None:
            return loss
        losses.indexer.append(indexer.item())
        return loss + settings.indexer_loss_weight * indexer

    def report(step: int, total: int, _: float) -> None:
        if progress is not None:
            progress(step, total, losses.next_token[-1])

    try:
        run_steps(
            plan,
            optimizer,
            partial(learning_rate, settings),
            step_loss,
            settings.grad_clip,
            after_update=balancer.step,
            progress=report,
        )
        return losses
    finally:
        balancer.remove()
        indexers.remove()
        for p in model.parameters():
            p.requires_grad_(False)


@torch.no_grad()
def perplexity(
    model: nn.Module,
    stream: torch.Tensor,
    seq_len: int,
    kv_dtype: torch.dtype | None = None,
) -> float:
    """exp(mean next-token cross-entropy) over consecutive windows of `stream`
    (each window predicts its last seq_len tokens from the ones before; `kv_dtype`:
    as `tools.prefill.prefill` takes it)."""
    count = (stream.numel() - 1) // seq_len
    if count < 1:
        raise ValueError(
            f"a stream of {stream.numel()} tokens has no window of {seq_len}"
        )
    windows = torch.stack(
        [stream[i * seq_len : (i + 1) * seq_len + 1] for i in range(count)]
    )
    total = 0.0
    for start in range(0, count, EVAL_WINDOWS_PER_FORWARD):
        batch = windows[start : start + EVAL_WINDOWS_PER_FORWARD]
        total += next_token_loss(model, batch, kv_dtype).item() * batch.shape[0]
    return math.exp(total / count)
