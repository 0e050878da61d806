"""A few steps of every stage of `tools.train_tiny`, on the shipped excerpt."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from atom.models.tiny import build, minimax
from atom.models.tiny.excerpt import HELD_OUT_FILE
from tools import fit_draft, train_tiny
from tools.prefill import load_model
from tools.tiny_family import FAMILIES
from tools.train_config import PRESETS, with_overrides

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def test_smoke_run_writes_loadable_weights_and_a_report(tmp_path):
    report = train_tiny.main(
        ["--config", "smoke", "--out", str(tmp_path), "--device", "cpu",
         "--corpus-excerpt", str(HELD_OUT_FILE), "--set", "k3.steps=3"]
    )  # fmt: skip
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["tiny-kimi-k3"]["loss"]["steps"] == 3
    assert on_disk == json.loads(json.dumps(report))
    for name in FAMILIES["kimi"].trained_files:
        assert report[name]["loss"]["first"] > 0
        tensors = load_file(str(tmp_path / f"{name}.safetensors"))
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    for name in ("tiny-kimi-k3", "tiny-kimi-linear"):
        assert report[name]["held_out_perplexity"] > 1
    greedy = report["tiny-kimi-k3-dspark"]["acceptance"]["greedy"]
    assert len(greedy["per_position_acceptance"]) == 7
    # The builders take the files as they are, and atom's strict loader takes those.
    k3 = {
        k: v.float()
        for k, v in load_file(str(tmp_path / "tiny-kimi-k3.safetensors")).items()
    }
    build.write_k3_layout(tmp_path / "k3", "KimiK31ForConditionalGeneration", k3)
    draft = load_file(str(tmp_path / "tiny-kimi-k3-dspark.safetensors"))
    build.write_dspark_draft(tmp_path / "draft", draft, k3[build.K3_TARGET_EMBED_NAME])
    target, config = load_model(str(tmp_path / "k3"))
    loaded = fit_draft.load_draft(str(tmp_path / "draft"), target, config)
    name = "layers.0.self_attn.o_proj.weight"
    assert dict(loaded.named_parameters())[name].equal(draft[name].float())


def test_minimax_smoke_run_trains_its_target_and_draft(tmp_path):
    report = train_tiny.main(
        ["--config", "minimax-smoke", "--out", str(tmp_path), "--device", "cpu",
         "--corpus-excerpt", str(HELD_OUT_FILE)]
    )  # fmt: skip
    assert report["family"] == "minimax"
    assert set(FAMILIES["minimax"].trained_files) <= report.keys()
    assert report["tiny-minimax-m3"]["held_out_perplexity"] > 1
    greedy = report["tiny-minimax-m3-dspark"]["acceptance"]["greedy"]
    assert len(greedy["per_position_acceptance"]) == 7
    # The M3.1 name over the same file, and the draft bound to it.
    m3 = {
        k: v.float()
        for k, v in load_file(str(tmp_path / "tiny-minimax-m3.safetensors")).items()
    }
    minimax.write_minimax(tmp_path / "m31", minimax.M31_ARCH, m3)
    draft = load_file(str(tmp_path / "tiny-minimax-m3-dspark.safetensors"))
    minimax.write_minimax_dspark(tmp_path / "draft", draft, None)
    target, config = load_model(str(tmp_path / "m31"))
    loaded = fit_draft.load_draft(str(tmp_path / "draft"), target, config)
    name = "layers.0.self_attn.o_proj.weight"
    assert dict(loaded.named_parameters())[name].equal(draft[name].float())


def test_a_preset_trains_only_its_familys_stages(tmp_path):
    with pytest.raises(SystemExit):
        train_tiny.parse_args(
            ["--config", "minimax-smoke", "--out", str(tmp_path), "--stages", "k3"]
        )


def test_overrides_are_checked():
    config = with_overrides(PRESETS["smoke"], ["k3.lr=0.5", "draft.prompt_len=3,4"])
    assert (config.targets["k3"].lr, config.draft.prompt_len) == (0.5, (3, 4))
    assert config.targets["linear"] == PRESETS["smoke"].targets["linear"]
    for bad in ["k3.nope=1", "k9.lr=1", "k3.lr", "m3.lr=1"]:
        with pytest.raises(ValueError, match="stage.field=value"):
            with_overrides(PRESETS["smoke"], [bad])
