"""The lightning indexer learns where the dense attention looks, and nothing else moves.

Through the hard top-k the next-token loss gives the indexer no gradient; its own
loss must reach exactly the indexer's weights (its rows of the merged projection and
its norms), and fall when only it is trained.
"""

from __future__ import annotations

import pytest
import torch

from atom.models.minimax_m3.attention import MiniMaxM3Attention
from tools.indexer_objective import SparseLayerHooks, indexer_loss, mean_kept_mass
from tools.prefill import load_model
from tools.train_target import ExpertBalancer, next_token_loss

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "tiny-minimax-m3"


def windows(seed: int, count: int = 2, length: int = 41) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4000, (count, length), generator=generator)


def index_rows(layer: MiniMaxM3Attention) -> slice:
    """The merged projection's rows that hold the index queries and key."""
    start = (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim
    return slice(start, layer.qkv_proj.weight.shape[0])


def test_the_indexer_loss_reaches_only_the_indexers():
    model, _ = load_model(MODEL)
    for p in model.parameters():
        p.requires_grad_(True)
    distillation = SparseLayerHooks(model, indexer_loss)
    assert len(distillation.layers) == 4  # layers 2-5 are sparse
    next_token_loss(model, windows(0))
    loss = distillation.take()
    assert loss is not None and loss.item() > 0 and distillation.take() is None
    loss.backward()
    distillation.remove()
    names = {p: n for n, p in model.named_parameters()}
    moved = {
        names[p] for p in model.parameters() if p.grad is not None and p.grad.any()
    }
    assert moved and all(".self_attn." in n for n in moved)
    for layer in distillation.layers:
        grad = layer.qkv_proj.weight.grad
        rows = index_rows(layer)
        assert grad[rows].abs().sum() > 0
        assert not grad[: rows.start].any()  # q, k, v rows: untouched
        assert layer.index_q_norm.weight.grad.abs().sum() > 0
        assert layer.q_norm.weight.grad is None or not layer.q_norm.weight.grad.any()
    assert not any(".mlp." in n or "embed" in n or "lm_head" in n for n in moved)


def test_training_only_the_indexers_lowers_their_loss_and_keeps_more_mass():
    model, _ = load_model(MODEL)
    indexer_params = []
    for layer in model.modules():
        if isinstance(layer, MiniMaxM3Attention) and layer.indexer is not None:
            indexer_params += [layer.qkv_proj.weight, layer.index_q_norm.weight,
                               layer.index_k_norm.weight]  # fmt: skip
    for p in indexer_params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(indexer_params, lr=3e-3)
    distillation = SparseLayerHooks(model, indexer_loss)
    batch = windows(1, count=4)
    kept_before = mean_kept_mass(model, batch.tolist())
    losses = []
    for _ in range(12):
        next_token_loss(model, batch)
        loss = distillation.take()
        optimizer.zero_grad()
        loss.backward()
        # The merged projection also holds q, k and v: keep only the index rows.
        for layer in distillation.layers:
            layer.qkv_proj.weight.grad[: index_rows(layer).start] = 0
        optimizer.step()
        losses.append(loss.item())
    distillation.remove()
    assert losses[-1] < 0.8 * losses[0]
    # The blocks the engine keeps now hold more of the dense attention's mass.
    assert mean_kept_mass(model, batch.tolist()) > kept_before


def test_the_balancer_finds_minimax_experts():
    model, _ = load_model(MODEL)
    balancer = ExpertBalancer(model, rate=0.01)
    assert len(balancer.moes) == 4  # layers 2-5 route
    balancer.remove()
