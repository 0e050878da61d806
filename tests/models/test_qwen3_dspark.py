"""MiniMax-M3's Qwen3 DSpark draft: binding, loading, and its block math.

The block pass is checked against a from-scratch reference written here from the
draft's definition (no transformers class exists): context rows from the taps, a
non-causal block over [x0, m, ...] at p+1..p+T, each row seeing context rows from
a - window + 1 to p, the target's head, then the Markov bias.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from atom.config import Config, load_hf_config
from atom.distributed.parallel_state import build_parallel_state
from atom.model_engine.cache_engine import CacheEngine
from atom.model_loader.loader import WeightLoadingError, load_weights
from atom.models.qwen3_dspark.model import Qwen3DSpark
from atom.models.registry import draft_tap_ids
from atom.models.tiny import resolve_model_path
from atom.models.tiny.configs import TOKEN_IDS
from atom.models.tiny.minimax_specs import draft_config
from atom.models.utils import PPMissingLayer, language_model_of
from tests.models.kimi_helpers import target_of
from tests.spec_decode.spec_helpers import loaded_drafter

TARGET, DRAFT, NO_EMBED = (
    "tiny-minimax-m3",
    "tiny-minimax-m3-dspark",
    "tiny-minimax-m3-dspark-no-embed",
)
T, BLOCK_SIZE = 4, 4
WINDOW = draft_config()["dflash_config"]["swa_window_size"]  # 16


pytestmark = pytest.mark.usefixtures("single_thread_torch")


def make_config(draft: str = DRAFT, **kwargs) -> Config:
    return Config(
        model=TARGET,
        method="dspark",
        draft_model=draft,
        num_speculative_tokens=T,
        max_num_batched_tokens=64,
        block_size=BLOCK_SIZE,
        **kwargs,
    )


@pytest.mark.parametrize("draft", [DRAFT, NO_EMBED])
def test_draft_binds_the_target_objects_and_skips_its_copies(draft):
    config = make_config(draft)
    target = target_of(config, load=False)
    drafter = loaded_drafter(config, target)
    model, lm = drafter.model, language_model_of(target)
    assert isinstance(model, Qwen3DSpark)
    assert model.embed_tokens is lm.model.embed_tokens
    assert model.lm_head is lm.lm_head
    skipped = drafter.load_report.skipped_declared
    assert ("embed_tokens.weight" in skipped) == (draft == DRAFT)
    assert "confidence_head.proj.weight" in skipped
    names = [name for name, _ in model.named_parameters()]
    assert not any(n.startswith(("embed_tokens.", "lm_head.")) for n in names)
    assert Qwen3DSpark.skip_weight_prefixes is model.skip_weight_prefixes
    assert type(Qwen3DSpark.skip_weight_prefixes) is list
    assert "skip_weight_prefixes" not in vars(model)


def test_pp_last_stage_shares_a_real_table_and_hooks_only_resident_taps():
    with build_parallel_state(pp_rank=1, pp_size=2):
        config = make_config(pipeline_parallel_size=2)
        target = target_of(config, load=False)
        drafter = loaded_drafter(config, target)
    base = language_model_of(target).model
    assert not isinstance(base.embed_tokens, PPMissingLayer)
    assert drafter.model.embed_tokens is base.embed_tokens
    assert drafter.tap_ids == [1, 4] and drafter.resident_taps == [4]
    assert len(base.embed_tokens._forward_hooks) == 0


def test_producer_binds_nothing():
    with build_parallel_state(pp_rank=1, pp_size=2):
        config = make_config(pipeline_parallel_size=2, kv_role="kv_producer")
        target = target_of(config, load=False)
        drafter = loaded_drafter(config, target)
    assert isinstance(language_model_of(target).model.embed_tokens, PPMissingLayer)
    assert drafter.model.embed_tokens is None and drafter.model.lm_head is None


def _edited(tmp_path, edit_tensors=None, edit_config=None) -> str:
    folder = tmp_path / "draft"
    shutil.copytree(resolve_model_path(DRAFT), folder)
    if edit_tensors is not None:
        tensors = load_file(str(folder / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_prefixed_names_load_and_d2t_or_missing_tensors_are_refused(tmp_path):
    prefixed = _edited(
        tmp_path, lambda t: t.update({f"model.{k}": t.pop(k) for k in list(t)})
    )
    load_weights(Qwen3DSpark(load_hf_config(prefixed)), prefixed)
    shutil.rmtree(prefixed)
    d2t = _edited(tmp_path, lambda t: t.update(d2t=torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match="d2t"):
        load_weights(Qwen3DSpark(load_hf_config(d2t)), d2t)
    shutil.rmtree(d2t)
    missing = _edited(tmp_path, lambda t: t.pop("layers.1.self_attn.v_proj.weight"))
    with pytest.raises(WeightLoadingError, match="layers.1.self_attn.qkv_proj"):
        load_weights(Qwen3DSpark(load_hf_config(missing)), missing)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["dflash_config"].update(causal=True), "causal"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 6]), "outside"),
        (lambda c: c["dflash_config"].update(num_target_layers=5), "num_target"),
        (lambda c: c["dflash_config"].pop("swa_window_size"), "swa_window_size"),
    ],
)
def test_bad_draft_configs_are_refused(tmp_path, edit, message):
    folder = _edited(tmp_path, edit_config=edit)
    target_text = load_hf_config(resolve_model_path(TARGET)).text
    with pytest.raises(ValueError, match=message):
        Qwen3DSpark(load_hf_config(folder), target_text)


def test_tap_ids_come_from_the_dflash_section():
    assert draft_tap_ids(load_hf_config(resolve_model_path(DRAFT))) == [1, 4]


# ---- the block math against a from-scratch reference ----


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta=1e6):
    """NeoX rotation of x [N, heads, d] over the whole head."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[:, None] * inv
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def keys_values(w, attn, x, positions, kv_heads=2, d=16):
    k = (x @ w[f"{attn}k_proj.weight"].t()).view(-1, kv_heads, d)
    k = rope(rms(k, w[f"{attn}k_norm.weight"]), positions)
    v = (x @ w[f"{attn}v_proj.weight"].t()).view(-1, kv_heads, d)
    return k, v


def reference_block_logits(w, taps, context_len, anchor, embed, head, window):
    """Base logits [T, V] for one sequence with context rows 0..context_len-1."""
    heads, kv_heads, d = 4, 2, 16
    c = rms(taps @ w["fc.weight"].t(), w["hidden_norm.weight"])
    ctx_pos = torch.arange(context_len)
    block_pos = context_len + torch.arange(T)
    ids = torch.tensor([anchor] + [TOKEN_IDS["mask_token_id"]] * (T - 1))
    h = embed[ids]
    for i in range(2):
        p = f"layers.{i}."
        a = f"{p}self_attn."
        k_ctx, v_ctx = keys_values(w, a, c, ctx_pos)  # no input_layernorm here
        x = rms(h, w[f"{p}input_layernorm.weight"])
        q = (x @ w[f"{a}q_proj.weight"].t()).view(-1, heads, d)
        q = rope(rms(q, w[f"{a}q_norm.weight"]), block_pos)
        k_blk, v_blk = keys_values(w, a, x, block_pos)
        k = torch.cat([k_ctx, k_blk]).repeat_interleave(heads // kv_heads, dim=1)
        v = torch.cat([v_ctx, v_blk]).repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        seen = ctx_pos[None, :] >= block_pos[:, None] - (window - 1)
        mask = torch.cat([seen, torch.ones(T, T, dtype=torch.bool)], dim=1)
        scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
        h = h + o @ w[f"{a}o_proj.weight"].t()
        y = rms(h, w[f"{p}post_attention_layernorm.weight"])
        gate, up = (
            y @ w[f"{p}mlp.gate_proj.weight"].t(),
            y @ w[f"{p}mlp.up_proj.weight"].t(),
        )
        h = h + (F.silu(gate) * up) @ w[f"{p}mlp.down_proj.weight"].t()
    return rms(h, w["norm.weight"]) @ head.t()


@pytest.fixture(scope="module")
def pp1():
    config = make_config()
    target = target_of(config)
    drafter = loaded_drafter(config, target)
    CacheEngine([target, drafter.model], 16, BLOCK_SIZE, 2, 0, "cpu", torch.float32)
    return target, drafter


@torch.no_grad()
def test_block_pass_matches_the_reference_and_honours_the_window(pp1):
    target, drafter = pp1
    draft = drafter.model
    weights = load_file(str(resolve_model_path(DRAFT) + "/model.safetensors"))
    lm = language_model_of(target)
    embed, head = lm.model.embed_tokens.weight, lm.lm_head.weight
    gen = torch.Generator().manual_seed(0)
    context_len, anchor = 21, 77
    taps = torch.randn(context_len, 2 * 64, generator=gen)
    slots = torch.arange(context_len)  # block table [0, ..., 5]: slot = position
    draft.write_context_kv(taps, slots.clone(), slots)
    table = torch.arange(6).view(1, 6)

    def block():
        return draft.block_forward(
            torch.tensor([anchor]), torch.tensor([context_len]), table, T
        )[0]

    got = block()
    expected = reference_block_logits(
        weights, taps, context_len, anchor, embed, head, WINDOW
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # Row 0 sits at position 21 and sees context rows 6..20; row 3 (24) sees 9..20.
    # Rows 0..5 are outside every row's window: changing them changes nothing.
    old = taps.clone()
    taps[:6] = torch.randn(6, 128, generator=gen)
    draft.write_context_kv(taps, slots.clone(), slots)
    assert torch.equal(block(), got)
    taps[6] = old[6] + 1.0  # inside row 0's window only
    draft.write_context_kv(taps, slots.clone(), slots)
    changed = (block() - got).abs().amax(dim=-1)
    assert changed[0] > 1e-3  # row 0 sees it directly; the others through row 0
    expected = reference_block_logits(
        weights, taps, context_len, anchor, embed, head, WINDOW
    )
    torch.testing.assert_close(block(), expected, atol=1e-4, rtol=1e-4)
