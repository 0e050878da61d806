"""Kimi-K3 target (tiny-kimi-k3) against the independent golden model.

Covers prefill, chunked prefill and decode through the caches in any split, the DSpark
taps, speculative verify snapshots + commit, K3.1 aliasing, grouped routing, and the
strict loader refusing an incomplete checkpoint.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom.model_engine.cuda_graph import PrefillShape
from atom.model_engine.model_inputs import build_step
from atom.model_loader.build import building_on
from atom.model_loader.loader import WeightLoadingError
from atom.models.kimi.model import KimiK3ForConditionalGeneration
from atom.models.registry import get_model_class
from atom.models.tiny import resolve_model_path
from atom.models.utils import language_model_of
from tests.models.kimi_helpers import (
    BLOCK_SIZE,
    assert_padding_changes_nothing,
    bind_caches,
    build_target,
    forward_rows,
    logits_of,
    padded_decode_runs,
    padded_prefill_runs,
    work,
)
from tests.reference.k3_golden import GoldenModel

TOL = {"atol": 2e-4, "rtol": 1e-4}
PROMPT = [5, 77, 301, 9, 640, 12, 999, 58, 410, 3, 150, 7, 888, 23, 64, 512]
OTHER = [700, 2, 19, 333, 45, 1000, 6, 81, 260, 14, 90, 501, 37, 8, 222, 71]


@pytest.fixture(scope="module")
def k3():
    model, config = build_target("tiny-kimi-k3")
    return model, GoldenModel.from_pretrained(config.model)


def chunks(ids: list[int], split: list[int]) -> list[tuple[list[int], int]]:
    """(rows, context_len) of each chunk of `ids` cut by `split`."""
    out, start = [], 0
    for size in split:
        out.append((ids[start : start + size], start))
        start += size
    assert start == len(ids)
    return out


def test_prefill_of_two_sequences_matches_golden(k3):
    model, golden = k3
    bind_caches(model)
    logits = logits_of(
        model, [work(PROMPT, slot=0), work(OTHER[:9], slot=1, first_block=16)]
    )
    torch.testing.assert_close(logits[:16], golden(PROMPT)[0], **TOL)
    torch.testing.assert_close(logits[16:], golden(OTHER[:9])[0], **TOL)


def test_chunked_prefill_decode_and_any_split_agree(k3):
    model, golden = k3
    bind_caches(model)
    # In one batch per step: A prefills in uneven chunks while B decodes token by
    # token; C is a single full prefill.
    plan_a = chunks(PROMPT, [5, 1, 7, 3])
    plan_b = chunks(OTHER, [1] * 16)
    rows_a, rows_b = [], []
    for step in range(16):
        seqs, owners = [], []
        if step < len(plan_a):
            ids, ctx = plan_a[step]
            seqs.append(work(ids, ctx, slot=0))
            owners.append((rows_a, len(ids)))
        ids, ctx = plan_b[step]
        seqs.append(work(ids, ctx, slot=1, first_block=16))
        owners.append((rows_b, 1))
        logits, start = logits_of(model, seqs), 0
        for rows, count in owners:
            rows.append(logits[start : start + count])
            start += count
    full = logits_of(model, [work(PROMPT, slot=2, first_block=32)])
    expected_a = golden(PROMPT)[0]
    torch.testing.assert_close(torch.cat(rows_a), expected_a, **TOL)
    torch.testing.assert_close(torch.cat(rows_b), golden(OTHER)[0], **TOL)
    torch.testing.assert_close(full, expected_a, **TOL)


def test_fresh_sequence_ignores_stale_slot_state(k3):
    model, golden = k3
    bind_caches(model)
    logits_of(model, [work(OTHER, slot=0)])
    # Same slot and blocks, context 0: nothing of OTHER may leak in.
    logits = logits_of(model, [work(PROMPT[:6], slot=0)])
    torch.testing.assert_close(logits, golden(PROMPT[:6])[0], **TOL)


def test_taps_equal_golden_hidden_states(k3):
    model, golden = k3
    bind_caches(model)
    text = language_model_of(model).model
    taps = {}
    hooks = [
        text.embed_tokens.register_forward_hook(
            lambda mod, args, out: taps.__setitem__(-1, out)
        )
    ]
    for index, layer in enumerate(text.layers):
        hooks.append(
            layer.register_forward_hook(
                lambda mod, args, out, i=index: taps.__setitem__(
                    i, mod.aux_hidden_state(out)
                )
            )
        )
    forward_rows(model, [work(PROMPT)])
    for hook in hooks:
        hook.remove()
    _, expected = golden(PROMPT)
    assert sorted(taps) == list(range(-1, len(text.layers)))
    for layer_id, tap in taps.items():
        torch.testing.assert_close(tap, expected[layer_id + 1], **TOL)


@pytest.mark.parametrize("num_rows", [1, 2, 4])
def test_verify_snapshots_then_commit_equal_sequential(k3, num_rows):
    model, golden = k3
    cache = bind_caches(model, spec_rows=4)
    prompt, verify_rows = PROMPT[:10], PROMPT[10:14]
    logits_of(model, [work(prompt, slot=0), work(prompt, slot=1, first_block=16)])
    untouched = [
        (m.conv_state[1].clone(), m.ssm_state[1].clone()) for m in cache.state_layers
    ]

    verified = logits_of(model, [work(verify_rows, 10, slot=0, num_drafts=3)])
    torch.testing.assert_close(verified, golden(PROMPT[:14])[0][10:], **TOL)
    for layer, (conv, ssm) in zip(cache.state_layers, untouched):
        # Only the verified slot moves: to the state after its last row, with every
        # row's state kept in the snapshots for the commit to choose from.
        assert torch.equal(layer.conv_state[1], conv) and torch.equal(
            layer.ssm_state[1], ssm
        )
        assert torch.equal(layer.ssm_state[0], layer.ssm_snapshots[0, 3])

    cache.commit([0], [num_rows])
    for offset, token in enumerate(verify_rows[:num_rows]):  # the sequential twin
        logits_of(model, [work([token], 10 + offset, slot=1, first_block=16)])
    for layer in cache.state_layers:
        torch.testing.assert_close(layer.ssm_state[0], layer.ssm_state[1], **TOL)
        torch.testing.assert_close(layer.conv_state[0], layer.conv_state[1], **TOL)

    # Decoding continues after the accepted rows; rejected rows' KV is overwritten.
    kept = PROMPT[: 10 + num_rows]
    nxt = logits_of(model, [work([900], len(kept), slot=0)])
    torch.testing.assert_close(nxt[0], golden(kept + [900])[0][-1], **TOL)


def test_k31_aliases_to_the_k3_classes():
    model, config = build_target("tiny-kimi-k31")
    assert config.hf_config.architecture == "KimiK31ForConditionalGeneration"
    assert get_model_class("KimiK31ForConditionalGeneration") is (
        KimiK3ForConditionalGeneration
    )
    assert type(model) is KimiK3ForConditionalGeneration
    bind_caches(model)
    expected = GoldenModel.from_pretrained(config.model)(PROMPT[:7])[0]
    torch.testing.assert_close(logits_of(model, [work(PROMPT[:7])]), expected, **TOL)


def test_grouped_routing_variant(tmp_path):
    source = resolve_model_path("tiny-kimi-k3")
    folder = tmp_path / "tiny-k3-grouped"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(
        num_expert_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    (folder / "config.json").write_text(json.dumps(config))
    model, _ = build_target(str(folder))
    bind_caches(model)
    expected = GoldenModel.from_pretrained(folder)(PROMPT)[0]
    torch.testing.assert_close(logits_of(model, [work(PROMPT)]), expected, **TOL)
    # Group limiting must matter here, or this test would not see it ignored.
    config["text_config"].update(num_expert_group=1, topk_group=1)
    (folder / "config.json").write_text(json.dumps(config))
    ungrouped = GoldenModel.from_pretrained(folder)(PROMPT)[0]
    assert (ungrouped - expected).abs().max() > 1e-2


def _single_file_copy(tmp_path, drop: str | None, rename=None) -> str:
    """tiny-kimi-k3 as one safetensors file, without `drop`, names passed through
    `rename`."""
    source = resolve_model_path("tiny-kimi-k3")
    folder = tmp_path / "copy"
    folder.mkdir()
    shutil.copy(f"{source}/config.json", folder / "config.json")
    index = json.loads(open(f"{source}/model.safetensors.index.json").read())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(f"{source}/{shard}"))
    assert drop is None or drop in tensors
    tensors = {
        (rename(name) if rename else name): t
        for name, t in tensors.items()
        if name != drop
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize(
    "drop, reported",
    [
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("model.layers.0.self_attn.A_log", "model.layers.0.self_attn.A_log"),
        ("model.layers.2.self_attn.v_conv1d.weight", "layers.2.self_attn.v_conv1d"),
        ("model.layers.3.self_attn.g_proj.weight", "model.layers.3.self_attn.g_proj"),
        (
            "model.layers.0.mlp.up_proj.weight",
            "layers.0.mlp.gate_up_proj.weight (shards ['1'])",
        ),
        (
            "model.layers.5.block_sparse_moe.experts.6.w3.weight",
            "layers.5.block_sparse_moe.experts.w13 (shards [\"(6, 'w3')\"])",
        ),
        (
            "model.layers.7.block_sparse_moe.gate.e_score_correction_bias",
            "model.layers.7.block_sparse_moe.gate.e_score_correction_bias",
        ),
        ("model.layers.4.mlp_res_proj.weight", "model.layers.4.mlp_res_proj.weight"),
        ("model.output_attn_res_norm.weight", "model.output_attn_res_norm.weight"),
    ],
)
def test_missing_tensor_refuses_to_load(tmp_path, drop, reported):
    folder = _single_file_copy(tmp_path, "language_model." + drop)
    with pytest.raises(WeightLoadingError, match="parameter never loaded") as err:
        build_target(folder)
    assert reported in str(err.value)


def test_alternate_spellings_and_skipped_tensors_load(tmp_path):
    """vLLM's `language_model.layers.`, plus MTP and rotary tensors atom skips."""

    def vllm_spelling(name: str) -> str:
        return name.replace("language_model.model.layers.", "language_model.layers.")

    folder = _single_file_copy(tmp_path, None, rename=vllm_spelling)
    extra = load_file(f"{folder}/model.safetensors")
    extra["language_model.model.layers.8.self_attn.q_proj.weight"] = torch.ones(2, 2)
    extra["language_model.model.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(extra, f"{folder}/model.safetensors")
    model, config = build_target(folder)
    bind_caches(model)
    expected = GoldenModel.from_pretrained(resolve_model_path("tiny-kimi-k3"))
    torch.testing.assert_close(
        logits_of(model, [work(PROMPT[:5])]), expected(PROMPT[:5])[0], **TOL
    )


def test_bfloat16_build_keeps_the_fp32_parameters(k3):
    _, golden = k3
    with building_on("cpu", torch.bfloat16):
        model, _ = build_target("tiny-kimi-k3")
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    kda = "language_model.model.layers.0.self_attn."
    assert {kda + n for n in ("A_log", "dt_bias", "o_norm.weight")} <= fp32
    assert kda + "q_conv1d.weight" in fp32
    # The router weight too: its logits are fp32 (RouterGate).
    assert any(name.endswith("block_sparse_moe.gate.weight") for name in fp32)
    assert all(
        name.rsplit(".", 2)[-2].endswith(("conv1d", "o_norm", "self_attn", "gate"))
        for name in fp32
    )
    cache = bind_caches(model)
    taps = {}
    layer0 = language_model_of(model).model.layers[0]
    layer0.register_forward_hook(
        lambda m, a, out: taps.update({0: m.aux_hidden_state(out)})
    )
    logits = logits_of(model, [work(PROMPT)])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert cache.kv_layers[0].kv_cache.dtype == torch.bfloat16
    # Deeper layers diverge through bf16 routing flips; layer 0 is dense.
    torch.testing.assert_close(
        taps[0].float(), golden(PROMPT)[1][1], atol=0.05, rtol=0.02
    )


def test_tiny_kimi_linear_matches_golden():
    """The flat layout: plain residual, softplus gate, legacy 4-D A_log, q_proj."""
    model, config = build_target("tiny-kimi-linear")
    bind_caches(model)
    expected = GoldenModel.from_pretrained(config.model)(PROMPT)[0]
    torch.testing.assert_close(logits_of(model, [work(PROMPT)]), expected, **TOL)


@pytest.mark.parametrize("num_drafts", [0, 3])
def test_graph_padded_decode_batch_equals_the_batch_alone(k3, num_drafts):
    """The dummy sequences that pad a captured graph's batch change nothing real:
    real rows, KV and states match the unpadded batch, and the dummies touch only
    the scratch block and slot."""
    model, golden = k3
    prompts = [PROMPT[:10], OTHER[:12]]
    rows = [PROMPT[10 : 11 + num_drafts], OTHER[12 : 13 + num_drafts]]
    unpadded, padded = padded_decode_runs(model, prompts, rows, num_drafts)
    metadata = padded.metadata
    assert metadata.num_seqs == 5 and metadata.query_len == 1 + num_drafts
    assert_padding_changes_nothing(unpadded, padded, TOL)
    expected = golden(prompts[0] + rows[0])[0][len(prompts[0]) :]
    torch.testing.assert_close(padded.logits[: len(rows[0])], expected, **TOL)


@pytest.mark.parametrize("length", [16, 11], ids=["fills-the-size", "padded"])
def test_graph_prefill_shape_equals_the_prompt_alone(k3, length):
    """A short prefill laid out as its captured shape (16 rows: the prompt, then a
    dummy sequence holding the rows it leaves) changes nothing real: the prompt's
    logits, KV rows and states match its unpadded prefill and the golden model's,
    and the dummy touches only the scratch block and slot. The layout's shapes do
    not depend on the prompt's length."""
    model, golden = k3
    prompt = PROMPT[:length]
    shape = PrefillShape(16, padded=length < 16)
    works = [work(prompt, slot=1, first_block=4)]
    unpadded, padded = padded_prefill_runs(model, works, shape)
    metadata = padded.metadata
    assert metadata.num_tokens == 16 and metadata.max_query_len == 16
    assert metadata.num_seqs == 1 + shape.padded and metadata.all_fresh
    assert_padding_changes_nothing(unpadded, padded, TOL)
    torch.testing.assert_close(padded.logits, golden(prompt)[0], **TOL)
    # Any prompt this shape takes builds the capture's layout.
    cache = bind_caches(model, num_blocks=32, slots=2)
    padding = shape.padding(cache.scratch_kv_slot, cache.scratch_state_slot)
    dummy = shape.dummy(20, cache.scratch_state_slot)
    layout = build_step(works, BLOCK_SIZE, 20, padding)[1]
    assert layout == build_step([dummy], BLOCK_SIZE, 20, padding)[1]
