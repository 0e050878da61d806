"""Exported checkpoints load back into the same parameters, for every tiny model."""

from __future__ import annotations

import pytest
import torch

from atom.models.tiny import build, trained
from tools import fit_draft
from tools.export import export_checkpoint
from tools.prefill import load_model

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def _write(name: str, folder, tensors) -> None:
    if name == "tiny-kimi-linear":
        build.write_kimi_linear(folder, tensors)
    elif name == "tiny-kimi-k3":
        build.write_k3_layout(folder, "KimiK3ForConditionalGeneration", tensors)


@pytest.mark.parametrize("name", ["tiny-kimi-linear", "tiny-kimi-k3"])
def test_target_export_round_trips_through_the_loader(name, tmp_path):
    template = trained.initial_tensors(name)
    _write(name, tmp_path / "a", template)
    model, _ = load_model(str(tmp_path / "a"))
    unchanged = export_checkpoint(model, template)
    assert all(unchanged[n].equal(t) for n, t in template.items())
    # Move every parameter; the export then reloads into exactly these values.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator))
    exported = export_checkpoint(model, template)
    _write(name, tmp_path / "b", exported)
    reloaded, _ = load_model(str(tmp_path / "b"))
    moved = dict(model.named_parameters())
    for param_name, param in reloaded.named_parameters():
        assert param.equal(moved[param_name]), param_name
    # What no parameter holds keeps the template's values (K3: stub vision tensors
    # and the A_log entries past the KDA heads).
    for tensor_name, value in template.items():
        if tensor_name.startswith("vision_tower."):
            assert exported[tensor_name].equal(value)
        if tensor_name.endswith("A_log") and value.dim() == 1:
            assert exported[tensor_name][4:].equal(value[4:])
            assert not exported[tensor_name][:4].equal(value[:4])


def test_draft_export_keeps_the_confidence_head(tmp_path):
    target, config = load_model("tiny-kimi-k3")
    template = trained.initial_tensors("tiny-kimi-k3-dspark")
    build.write_dspark_draft(tmp_path / "a", template, None)
    draft = fit_draft.load_draft(str(tmp_path / "a"), target, config)
    with torch.no_grad():
        for param in draft.parameters():
            param.mul_(2.0)
    exported = export_checkpoint(draft, template)
    assert exported["confidence_head.bias"].equal(template["confidence_head.bias"])
    name = "layers.1.self_attn.q_b_proj.weight"
    assert exported[name].equal(2.0 * template[name])
