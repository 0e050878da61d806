import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atom.models.tiny import (
    TINY_MODELS,
    TINY_VERSION,
    build_tiny_checkpoint,
    is_tiny_model,
    resolve_model_path,
    trained,
)
from atom.models.tiny.configs import TINY_VOCAB_SIZE as VOCAB
from atom.models.tiny.tokenizer import SPECIAL_TOKENS

REPO_ROOT = Path(__file__).resolve().parents[2]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _load_all(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    for name in TINY_MODELS:
        build_tiny_checkpoint(name, root / name)
    return {name: root / name for name in TINY_MODELS}


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_build_is_byte_deterministic(name, built, tmp_path):
    build_tiny_checkpoint(name, tmp_path / "again")
    first, second = _files(built[name]), _files(tmp_path / "again")
    assert first.keys() >= {"config.json", "generation_config.json", "tokenizer.json"}
    assert first == second


# (release, its later release, the draft with its embedding copy, the draft without)
_RELEASE_PAIRS = [
    ("tiny-kimi-k3", "tiny-kimi-k31", "tiny-kimi-k3-dspark", "tiny-kimi-k31-dspark"),
    ("tiny-minimax-m3", "tiny-minimax-m31", "tiny-minimax-m3-dspark",
     "tiny-minimax-m3-dspark-no-embed"),
]  # fmt: skip


@pytest.mark.parametrize("first, later, draft, bare_draft", _RELEASE_PAIRS)
def test_later_release_reuses_the_first_pair(built, first, later, draft, bare_draft):
    """K3.1 (M3.1) is the same stack under another architecture name, so it ships
    the K3 (M3) weights, and its draft the same draft without the embedding copy."""
    tensors, later_tensors = _load_all(built[first]), _load_all(built[later])
    assert tensors.keys() == later_tensors.keys()
    assert all(value.equal(later_tensors[name]) for name, value in tensors.items())
    config = json.loads((built[first] / "config.json").read_text())
    later_config = json.loads((built[later] / "config.json").read_text())
    assert later_config["text_config"] == config["text_config"]
    assert later_config["architectures"] != config["architectures"]
    with_copy, without = _load_all(built[draft]), _load_all(built[bare_draft])
    assert with_copy.keys() - without.keys() == {"embed_tokens.weight"}
    assert all(with_copy[n].equal(v) for n, v in without.items())
    assert with_copy["embed_tokens.weight"].equal(
        tensors["language_model.model.embed_tokens.weight"]
    )


@pytest.mark.parametrize("name", trained.TRAINED_FILES)
def test_checkpoints_hold_the_shipped_trained_weights(name, built):
    shipped = load_file(str(trained.trained_path(name)))
    assert all(t.dtype == torch.bfloat16 for t in shipped.values())
    tensors = _load_all(built[name])
    assert all(tensors[n].equal(v.float()) for n, v in shipped.items())
    # Trained: every tensor a gradient reaches moved away from the seeded init.
    initial = trained.initial_tensors(name)
    untrained = {
        n for n, v in shipped.items() if v.float().equal(initial[n].bfloat16().float())
    }
    assert untrained == _UNTRAINED[name]


# Tensors no gradient reaches: the stub vision tower and the draft's confidence
# head (atom skips both), and layer 0's AttnRes attention-site mix (its bank is
# empty, so it mixes one candidate: the identity).
_UNTRAINED = {
    "tiny-kimi-linear": set(),
    "tiny-kimi-k3": {
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.encoder.final_layernorm.weight",
        "mm_projector.pre_norm.weight",
        "mm_projector.proj.0.weight",
        "language_model.model.layers.0.self_attention_res_proj.weight",
        "language_model.model.layers.0.self_attention_res_norm.weight",
    },
    "tiny-kimi-k3-dspark": {"confidence_head.proj.weight", "confidence_head.bias"},
    # The lightning indexer trains too (tools/indexer_objective.py).
    "tiny-minimax-m3": {
        "vision_tower.vision_model.pre_layrnorm.weight",
        "multi_modal_projector.linear_1.weight",
        "patch_merge_mlp.linear_1.weight",
    },
    "tiny-minimax-m3-dspark": {"confidence_head.proj.weight", "confidence_head.bias"},
}


def test_kimi_linear_layout(built):
    tensors = _load_all(built["tiny-kimi-linear"])
    expected = {
        "model.embed_tokens.weight": (VOCAB, 128),
        "lm_head.weight": (VOCAB, 128),
        "model.layers.0.self_attn.q_conv1d.weight": (128, 1, 4),
        "model.layers.0.self_attn.A_log": (1, 1, 4, 1),
        "model.layers.0.self_attn.g_a_proj.weight": (32, 128),
        "model.layers.0.self_attn.g_b_proj.weight": (128, 32),
        "model.layers.0.mlp.gate_proj.weight": (256, 128),
        "model.layers.1.self_attn.q_proj.weight": (4 * 48, 128),
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": (48, 128),
        "model.layers.1.block_sparse_moe.experts.7.w2.weight": (128, 64),
        "model.layers.3.block_sparse_moe.shared_experts.down_proj.weight": (128, 64),
    }
    assert {n: tuple(tensors[n].shape) for n in expected} == expected
    assert not any(
        "res_proj" in n or "g_proj" in n or "routed_expert" in n for n in tensors
    )
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_k3_layout_is_sharded_with_real_names(built):
    folder = built["tiny-kimi-k3"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    tensors = _load_all(folder)
    assert set(index["weight_map"]) == set(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total
    m = "language_model.model."
    expected = {
        f"{m}layers.0.self_attn.A_log": (6,),  # 4 heads + 2 spare, as real K3
        f"{m}layers.0.self_attn.g_proj.weight": (128, 128),
        f"{m}layers.0.self_attention_res_proj.weight": (1, 128),
        f"{m}layers.0.mlp_res_norm.weight": (128,),
        f"{m}layers.1.self_attn.q_a_proj.weight": (64, 128),
        f"{m}layers.1.self_attn.q_b_proj.weight": (4 * 48, 64),
        f"{m}layers.1.self_attn.g_proj.weight": (128, 128),
        f"{m}layers.1.block_sparse_moe.routed_expert_down_proj.weight": (64, 128),
        f"{m}layers.1.block_sparse_moe.routed_expert_up_proj.weight": (128, 64),
        f"{m}layers.1.block_sparse_moe.routed_expert_norm.weight": (64,),
        f"{m}layers.7.block_sparse_moe.experts.7.w1.weight": (64, 64),
        f"{m}layers.7.block_sparse_moe.shared_experts.gate_proj.weight": (128, 128),
        f"{m}output_attn_res_proj.weight": (1, 128),
        "language_model.lm_head.weight": (VOCAB, 128),
        "mm_projector.proj.0.weight": (128, 128),
    }
    assert {n: tuple(tensors[n].shape) for n in expected} == expected
    assert any(n.startswith("vision_tower.") for n in tensors)
    assert not any(n.startswith("model.") or "g_a_proj" in n for n in tensors)


def test_k3_initialisation_keeps_every_path_alive():
    """Zero or constant inits would hide broken paths, and training starts here."""
    tensors = trained.initial_tensors("tiny-kimi-k3")
    m = "language_model.model.layers."
    assert tensors[f"{m}2.mlp_res_proj.weight"].abs().min() > 0
    assert tensors[f"{m}2.block_sparse_moe.gate.e_score_correction_bias"].std() > 0.01
    a_log = tensors[f"{m}0.self_attn.A_log"]
    assert a_log.min() >= 0 and a_log.max() <= math.log(16)
    dt = torch.nn.functional.softplus(tensors[f"{m}0.self_attn.dt_bias"])
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    norm = tensors[f"{m}0.input_layernorm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm)) and (norm - 1).abs().max() < 1


def test_draft_layouts(built):
    target = _load_all(built["tiny-kimi-k3"])
    k3_draft = _load_all(built["tiny-kimi-k3-dspark"])
    k31_draft = _load_all(built["tiny-kimi-k31-dspark"])
    assert torch.equal(
        k3_draft["embed_tokens.weight"],
        target["language_model.model.embed_tokens.weight"],
    )
    assert "embed_tokens.weight" not in k31_draft
    assert k3_draft.keys() - k31_draft.keys() == {"embed_tokens.weight"}
    expected = {
        "context_proj.weight": (128, 4 * 128),
        "layers.1.self_attn.q_b_proj.weight": (4 * 48, 64),
        "layers.1.self_attn.kv_a_proj_with_mqa.weight": (48, 128),
        "layers.1.self_attn.kv_b_proj.weight": (4 * 64, 32),
        "layers.1.mlp.down_proj.weight": (128, 256),
        "markov_head.markov_w1.weight": (VOCAB, 16),
        "confidence_head.proj.weight": (1, 128 + 16),
        "confidence_head.bias": (1,),
        "final_norm.weight": (128,),
    }
    assert {n: tuple(k31_draft[n].shape) for n in expected} == expected
    assert not any("lm_head" in n or "g_proj" in n for n in k31_draft)


def test_configs_agree_with_tokenizer_and_target(built):
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["tiny-kimi-k3-dspark"])
    draft = json.loads((built["tiny-kimi-k3-dspark"] / "config.json").read_text())
    target = json.loads((built["tiny-kimi-k3"] / "config.json").read_text())
    text = target["text_config"]
    assert draft["mask_token_id"] == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert target["eos_token_id"] == tokenizer.eos_token_id < text["vocab_size"]
    assert draft["hidden_size"] == draft["target_hidden_size"] == text["hidden_size"]
    assert draft["target_num_hidden_layers"] == text["num_hidden_layers"]
    assert draft["kv_lora_rank"] + draft["qk_rope_head_dim"] == 48
    assert target["architectures"] == ["KimiK3ForConditionalGeneration"]
    k31 = json.loads((built["tiny-kimi-k31"] / "config.json").read_text())
    assert k31["architectures"] == ["KimiK31ForConditionalGeneration"]
    assert k31["text_config"] == text
    kl = AutoConfig.from_pretrained(built["tiny-kimi-linear"])
    assert (kl.num_local_experts, kl.num_experts_per_tok, kl.n_group) == (8, 2, 4)
    assert kl.layer_types == ["linear_attention", "full_attention"] * 2
    assert kl.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]


def test_tokenizer_round_trips_and_loads(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["tiny-kimi-k3"])
    assert len(tokenizer) == VOCAB
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    first_special = VOCAB - len(SPECIAL_TOKENS)
    assert list(ids.values()) == list(range(first_special, VOCAB))
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id) == (4088, 4095)
    for text in [
        "Hello, world!",
        "  tabs\tand\nnewlines ",
        "Grüße, 你好 🚀 ∑ ≈ ☃",
        "x",
    ]:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        assert max(encoded) < first_special
        assert tokenizer.decode(encoded) == text
    # Trained on the corpus: its words are single tokens.
    words = "And the LORD spake unto Moses, saying"
    assert len(tokenizer.encode(words, add_special_tokens=False)) == 8
    chat = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_user|>hi<|im_end|><|im_assistant|>"


def test_resolve_model_path(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="tiny-kimi-k3") as err:
        resolve_model_path("tiny-kimi-k4")
    assert "tiny-kimi-k4" in str(err.value)
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path))
    assert not is_tiny_model("tiny-kimi-k4") and is_tiny_model("tiny-kimi-k3")

    path = resolve_model_path("tiny-kimi-k31-dspark")
    expected = tmp_path / "cache" / "tiny" / f"tiny-kimi-k31-dspark-v{TINY_VERSION}"
    assert Path(path) == expected and (expected / "config.json").is_file()
    stamp = (expected / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("tiny-kimi-k31-dspark") == path
    assert (expected / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_model_path(path) == path


def test_parallel_processes_build_one_complete_folder(tmp_path):
    """Two processes race to build the same name; both see the same finished folder."""
    env = {**os.environ, "ATOM_CACHE": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    code = "from atom.models.tiny import resolve_model_path as r; print(r('tiny-kimi-k3-dspark'))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1]
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == [Path(outputs[0]).name]
    build_tiny_checkpoint("tiny-kimi-k3-dspark", tmp_path / "here")
    assert _files(Path(outputs[0])) == _files(tmp_path / "here")
