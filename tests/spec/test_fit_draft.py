"""The fitting script trains the engine's draft math, and the tiny drafts ship fitted.

`draft_objective.block_logits` is a differentiable whole-sequence rewrite of the
engine's paged block pass; it must give the engine path's logits on the same inputs,
or the fitted weights would be fitted to a different model.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import load_file

from atom.model_engine.cache_engine import CacheEngine
from atom.models.tiny import fit_draft, resolve_model_path
from atom.models.tiny.build import (
    DRAFT_SEEDS,
    build_dspark_draft,
    fitted_draft_path,
)
from atom.models.tiny.configs import dspark_config, k3_text_config
from atom.models.tiny.draft_objective import block_logits, teacher_forced_logits
from atom.models.tiny.weights import dspark_specs, materialize
from tests.spec.spec_helpers import one_thread  # noqa: F401  (autouse fixture)

TARGET = "tiny-kimi-k3"
DRAFT = "tiny-kimi-k3-dspark"
BLOCK = 4


@pytest.fixture(scope="module")
def setup():
    target, config = fit_draft.load_target(TARGET)
    draft = fit_draft.load_draft(resolve_model_path(DRAFT), target, config)
    generator = torch.Generator().manual_seed(0)
    sequences = [
        torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (30, 19)
    ]
    traces = fit_draft.trace(target, list(draft.tap_ids), sequences, [0, 0])
    return target, config, draft, traces


def test_training_forward_equals_engine_block_pass(setup):
    _, _, draft, traces = setup
    width = 5
    tokens = torch.zeros(2, 30, dtype=torch.long)
    taps = torch.zeros(2, 30, traces.taps[0].shape[-1])
    for row, (seq, tap) in enumerate(zip(traces.tokens, traces.taps)):
        tokens[row, : len(seq)] = torch.tensor(seq)
        taps[row, : len(seq)] = tap
    anchors = torch.tensor([[0, 11, 23], [2, 7, 12]])
    with torch.no_grad():
        base = block_logits(draft, taps, tokens, anchors, width)
        markov = teacher_forced_logits(draft, base, tokens, anchors)
    # The engine path: context rows written into a paged cache, then block_forward.
    CacheEngine([draft], 32, BLOCK, 1, 0, "cpu", torch.float32)
    tables = [list(range(0, 16)), list(range(16, 32))]
    for table, seq, tap in zip(tables, traces.tokens, traces.taps):
        positions = torch.arange(len(seq))
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in positions])
        draft.write_context_kv(tap, positions, slots)
    with torch.inference_mode():
        for row, table in enumerate(tables):
            for col, p in enumerate(anchors[row].tolist()):
                anchor = tokens[row, p + 1].view(1)
                engine = draft.block_forward(
                    anchor, torch.tensor([p + 1]), torch.tensor([table]), width
                )
                torch.testing.assert_close(base[row, col], engine[0], atol=1e-4, rtol=0)
                previous = tokens[row, p + 1 : p + 1 + width]
                engine_markov = engine[0] + draft.markov_bias(previous)
                torch.testing.assert_close(
                    markov[row, col], engine_markov, atol=1e-4, rtol=0
                )
    # Context rows past p are never read: changing them leaves the block unchanged.
    spoiled = taps.clone()
    spoiled[0, 12:] = 0
    with torch.no_grad():
        again = block_logits(draft, spoiled[:1], tokens[:1], anchors[:1, 1:2], width)
    torch.testing.assert_close(again[0, 0], base[0, 1])


def test_checkpoint_tensors_round_trip(setup, tmp_path):
    target, config, draft, _ = setup
    tensors = fit_draft.checkpoint_tensors(draft)
    assert "layers.0.mlp.gate_proj.weight" in tensors
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in tensors)
    build_dspark_draft(DRAFT, tmp_path, fitted=tensors)
    reloaded = fit_draft.load_draft(str(tmp_path), target, config)
    for (name, a), (_, b) in zip(draft.named_parameters(), reloaded.named_parameters()):
        assert a.equal(b), name


def test_training_is_seeded_and_lowers_the_loss(setup):
    target, config, _, traces = setup
    args = argparse.Namespace(
        seed=0, steps=4, lr=3e-3, batch_seqs=2, anchors_per_seq=3,
        num_speculative_tokens=7,
    )  # fmt: skip
    results = []
    for _ in range(2):
        draft = fit_draft.load_draft(resolve_model_path(DRAFT), target, config)
        losses = fit_draft.train(draft, traces, args)
        results.append((losses, fit_draft.checkpoint_tensors(draft)))
    (losses, tensors), (losses_again, tensors_again) = results
    assert losses == losses_again
    assert all(tensors[n].equal(tensors_again[n]) for n in tensors)
    assert not any(p.requires_grad for p in draft.parameters())


@pytest.mark.parametrize("name", list(DRAFT_SEEDS))
def test_tiny_drafts_ship_their_fitted_weights(name):
    fitted = load_file(str(fitted_draft_path(name)))
    shipped = load_file(f"{resolve_model_path(name)}/model.safetensors")
    for tensor_name, value in fitted.items():
        assert value.dtype == torch.float32
        assert shipped[tensor_name].equal(value), tensor_name
    # Fitted: every trained tensor moved away from its seeded initialisation.
    config = dspark_config(k3_text_config())
    seed, embedding_of = DRAFT_SEEDS[name]
    initial = materialize(dspark_specs(config, with_embedding=False), seed)
    assert all(not initial[n].equal(v) for n, v in fitted.items())
    # Only the draft's own weights are fitted; the layouts stay as published.
    assert set(initial) - set(fitted) == {
        "confidence_head.proj.weight",
        "confidence_head.bias",
    }
    assert ("embed_tokens.weight" in shipped) == (embedding_of is not None)
