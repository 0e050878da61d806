"""Target training runs through atom's own forward, and gradients reach the model."""

from __future__ import annotations

import pytest
import torch

from atom.model_ops.grouped_experts import ExpertChoice
from tools.prefill import load_model
from tools.train_target import (
    ExpertBalancer,
    TargetSettings,
    next_token_loss,
    perplexity,
    random_windows,
    token_stream,
    train_target,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

# Parameters no gradient reaches in the K3 stack: the routers' correction biases
# (they only pick experts) and layer 0's attention-site AttnRes mix (its bank is
# empty, so the mix is the identity).
NO_GRADIENT = {
    "e_score_correction_bias",
    "0.self_attention_res_proj",
    "0.self_attention_res_norm",
}


def test_every_parameter_but_the_known_ones_gets_a_gradient():
    model, _ = load_model("tiny-kimi-k3")
    for p in model.parameters():
        p.requires_grad_(True)
    windows = torch.randint(
        0, 4000, (2, 40), generator=torch.Generator().manual_seed(0)
    )
    next_token_loss(model, windows).backward()
    silent = {
        name
        for name, p in model.named_parameters()
        if p.grad is None or not p.grad.abs().sum() > 0
    }
    assert silent and all(any(key in name for key in NO_GRADIENT) for name in silent)
    assert sum("e_score_correction_bias" in name for name in silent) == 7


def test_training_is_seeded_and_lowers_the_loss():
    stream = token_stream(lambda t: [ord(c) for c in t], ["abcabc abcabc"] * 40, 4089)
    assert stream[13].item() == 4089 and stream.numel() == 40 * 14
    settings = TargetSettings(
        steps=4, seqs_per_step=2, seq_len=24, lr=3e-3, warmup_steps=1
    )
    runs = []
    for _ in range(2):
        model, _ = load_model("tiny-kimi-linear")
        losses = train_target(model, stream, settings, seed=0).next_token
        runs.append((losses, {n: p.clone() for n, p in model.named_parameters()}))
    (losses, params), (again, params_again) = runs
    assert losses == again and all(params[n].equal(params_again[n]) for n in params)
    assert losses[-1] < losses[0]
    assert not any(p.requires_grad for p in model.parameters())
    # Perplexity: consecutive windows, each predicting its last seq_len tokens.
    windows = torch.stack([stream[i * 24 : i * 24 + 25] for i in range(4)])
    expected = next_token_loss(model, windows).exp().item()
    assert abs(perplexity(model, stream[:100], 24) - expected) < 1e-3 * expected


def test_balancer_lowers_the_bias_of_busy_experts():
    model, _ = load_model("tiny-kimi-linear")
    balancer = ExpertBalancer(model, rate=0.01)
    moe = balancer.moes[0]
    before = moe.gate.e_score_correction_bias.clone()
    busy = torch.zeros(5, 2, dtype=torch.long)  # every token picks expert 0
    moe.experts(torch.zeros(5, 128), ExpertChoice(torch.ones(5, 2), busy))
    assert balancer.step() == 8.0  # max / mean load
    change = moe.gate.e_score_correction_bias - before
    assert change[0] < 0 and (change[1:] > 0).all()
    balancer.remove()


def test_windows_are_seeded_slices_of_the_stream():
    stream = torch.arange(100)
    a = random_windows(stream, 3, 10, torch.Generator().manual_seed(1))
    b = random_windows(stream, 3, 10, torch.Generator().manual_seed(1))
    assert a.equal(b) and ((a[:, 1:] - a[:, :-1]) == 1).all()
