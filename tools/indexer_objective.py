"""Train the lightning indexer of block-sparse layers alongside the language model.

A sparse layer keeps the key blocks its indexer scores best through a hard top-k,
which passes no gradient, so next-token training alone never teaches the indexer
what to pick. As DeepSeek-V3.2's indexer is trained, it learns instead to predict
where the dense attention would look: for every query row and index head g (one per
KV group), the target is the probability mass that the group's query heads, averaged,
put on each visible key block under dense attention, and the loss is
KL(target || softmax(block scores)) over the blocks, with the block scores pooled as
the engine pools them (`atom/model_ops/block_sparse.py`). The target and the layer's
input are detached: this loss moves only the indexer's projections and norms, never
the attention it imitates or the layers below. `kept_mass` measures the result: the
share of the dense attention's mass that the blocks the engine keeps hold.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atom.model_ops.block_sparse import kept_blocks, pooled_block_scores
from atom.model_ops.visibility import sequence_visibility
from atom.models.minimax_m3.attention import MiniMaxM3Attention
from atom.utils.arithmetic import ceil_div
from atom.utils.forward_context import require_metadata
from tools.prefill import prefill


def _dense_block_mass(
    layer: MiniMaxM3Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    visible: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """[B, G, Q, blocks]: the dense attention's mass per key block, query heads of
    each KV group averaged. q [B, Q, h, d]; k [B, S, G, d]; visible [B, Q, S]."""
    group = layer.num_heads // layer.num_kv_heads
    k = k.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.float(), k.float()) * layer.scale
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # rows that see nothing: 0
    probs = probs.unflatten(1, (layer.num_kv_heads, group)).mean(dim=2)
    num_keys = probs.shape[-1]
    pad = ceil_div(num_keys, block_size) * block_size - num_keys
    probs = nn.functional.pad(probs, (0, pad))
    return probs.unflatten(-1, (-1, block_size)).sum(dim=-1)


def _block_distributions(
    layer: MiniMaxM3Attention, positions: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense attention mass per block, detached; the indexer's pooled block scores)
    [B, G, Q, blocks] for one fresh prefill (every key is one of this forward's rows).
    """
    metadata = require_metadata(f"indexer objective {layer.prefix!r}")
    if not metadata.all_fresh:
        raise ValueError("the indexer objective needs a fresh prefill (no cached rows)")
    q, rows, index_q = layer._cache_rows(positions, x.detach())
    rows = metadata.pad(rows)
    visible = sequence_visibility(metadata, rows.shape[1])
    width = layer.kv_width
    k, index_k = rows[..., :width], rows[..., 2 * width :]
    block_size = layer.indexer.block_size
    with torch.no_grad():
        mass = _dense_block_mass(
            layer,
            metadata.pad(q),
            k.unflatten(-1, (layer.num_kv_heads, layer.head_dim)),
            visible,
            block_size,
        )
    scores = pooled_block_scores(metadata.pad(index_q), index_k, visible, block_size)
    return mass, scores


def indexer_loss(
    layer: MiniMaxM3Attention, positions: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """The layer's indexer KL, mean over the query rows and index heads."""
    target, scores = _block_distributions(layer, positions, x)
    seen = scores > float("-inf")
    log_probs = scores.log_softmax(dim=-1)
    terms = torch.where(
        target > 0, target * (target.clamp_min(1e-12).log() - log_probs), 0.0
    )
    terms = torch.where(seen, terms, 0.0)
    return terms.sum(dim=-1)[seen.any(dim=-1)].mean()


@torch.no_grad()
def kept_mass(
    layer: MiniMaxM3Attention, positions: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """The dense attention mass inside the blocks the engine keeps (forced local
    and initial blocks included), mean over the query rows and index heads."""
    mass, scores = _block_distributions(layer, positions, x)
    query_positions = require_metadata("kept_mass").query_positions
    keep = kept_blocks(scores, query_positions, layer.indexer)
    seen = (scores > float("-inf")).any(dim=-1)
    return (mass * keep).sum(dim=-1)[seen].mean()


Measure = Callable[[MiniMaxM3Attention, torch.Tensor, torch.Tensor], torch.Tensor]


class SparseLayerHooks:
    """Forward hooks on every sparse attention layer of `model` that evaluate
    `measure(layer, positions, x)` (`indexer_loss`, `kept_mass`) in each forward;
    `take()` returns their mean and clears them."""

    def __init__(self, model: nn.Module, measure: Measure) -> None:
        self.layers = [
            m
            for m in model.modules()
            if isinstance(m, MiniMaxM3Attention) and m.indexer is not None
        ]
        self.measure = measure
        self._pending: list[torch.Tensor] = []
        self.handles = [
            layer.register_forward_hook(self._hook) for layer in self.layers
        ]

    def _hook(self, layer: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._pending.append(self.measure(layer, *args))

    def take(self) -> torch.Tensor | None:
        """The mean over the layers and forwards since the last call (None without
        sparse layers)."""
        if not self._pending:
            return None
        total = torch.stack(self._pending).mean()
        self._pending = []
        return total

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def mean_kept_mass(model: nn.Module, sequences: list[list[int]]) -> float | None:
    """`kept_mass` over one prefill of `sequences`, averaged over the sparse layers
    (None for a model without them)."""
    hooks = SparseLayerHooks(model, kept_mass)
    try:
        prefill(model, sequences)
        value = hooks.take()
    finally:
        hooks.remove()
    return None if value is None else value.item()
