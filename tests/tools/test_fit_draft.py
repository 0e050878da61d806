"""The distillation trains the engine's draft math.

`draft_objective.block_logits` is a differentiable whole-sequence rewrite of the
engine's paged block pass; it must give the engine path's logits on the same inputs,
or the draft would be distilled into a different model. Both draft kinds: Kimi's
MLA draft and MiniMax's Qwen3 GQA draft, whose 16-position window the 30-token
sequences cross.
"""

from __future__ import annotations

import pytest
import torch

from atom.model_engine.cache_engine import CacheEngine
from atom.models.tiny import resolve_model_path
from atom.models.utils import language_model_of
from tools import fit_draft
from tools.draft_objective import block_logits, teacher_forced_logits
from tools.export import export_checkpoint
from tools.prefill import load_model

pytestmark = pytest.mark.usefixtures("single_thread_torch")

PAIRS = {
    "kimi": ("tiny-kimi-k3", "tiny-kimi-k3-dspark"),
    "minimax": ("tiny-minimax-m3", "tiny-minimax-m3-dspark"),
}
BLOCK = 4


@pytest.fixture(scope="module", params=sorted(PAIRS))
def setup(request):
    target_name, draft_name = PAIRS[request.param]
    target, config = load_model(target_name)
    draft_dir = resolve_model_path(draft_name)
    draft = fit_draft.load_draft(draft_dir, target, config)
    generator = torch.Generator().manual_seed(0)
    sequences = [
        torch.randint(0, 4000, (n,), generator=generator).tolist() for n in (30, 19)
    ]
    traces = fit_draft.trace(target, list(draft.tap_ids), sequences, [0, 0])
    return target, config, draft_dir, draft, traces


def test_training_forward_equals_engine_block_pass(setup):
    _, _, _, draft, traces = setup
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


def test_training_is_seeded_and_moves_only_the_drafts_own_weights(setup):
    target, config, draft_dir, _, traces = setup
    settings = fit_draft.DraftSettings(
        prompts=0, prompt_len=(1, 1), new_tokens=0, sample_temperature=1.0,
        corpus_windows=0, window_len=0, steps=3, batch_seqs=2, anchors_per_seq=3,
        lr=3e-3, warmup_steps=1,
    )  # fmt: skip
    table = language_model_of(target).model.embed_tokens.weight
    embedding = table.clone()
    results = []
    for _ in range(2):
        draft = fit_draft.load_draft(draft_dir, target, config)
        template = {n: p.detach().clone() for n, p in draft.named_parameters()}
        losses = fit_draft.train(draft, traces, settings, seed=0)
        results.append((losses, {n: p.clone() for n, p in draft.named_parameters()}))
    (losses, params), (losses_again, params_again) = results
    assert losses == losses_again
    assert all(params[n].equal(params_again[n]) for n in params)
    assert any(not params[n].equal(template[n]) for n in params)
    assert not any(p.requires_grad for p in draft.parameters())
    assert table.equal(embedding)
    # The shared table and head are not the draft's parameters.
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in params)
    # The export splits the merged projection back into its checkpoint halves.
    merged = draft.layers[0].mlp.gate_up_proj.weight
    inner = merged.shape[0] // 2
    up = "layers.0.mlp.up_proj.weight"
    shipped = export_checkpoint(draft, {up: torch.zeros(inner, merged.shape[1])})
    assert shipped[up].equal(merged[inner:])
