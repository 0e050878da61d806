"""The strict loader: every parameter is loaded or declared skipped, or it fails."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from atom.distributed.launch import run_ranks
from atom.distributed.parallel_state import build_parallel_state
from atom.model_loader.loader import WeightLoadingError, load_weights
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import MergedColumnParallelLinear, RowParallelLinear
from atom.models.utils import make_layers


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(8, [4, 4])
        self.down_proj = RowParallelLinear(4, 8)
        self.norm = RMSNorm(8)


class TinyModel(nn.Module):
    skip_weight_prefixes = ["vision_tower."]
    packed_modules_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self):
        super().__init__()
        _, _, self.layers = make_layers(4, lambda prefix: Block(), "layers")


def checkpoint_tensors():
    g = torch.Generator().manual_seed(0)
    out = {"vision_tower.patch.weight": torch.randn(2, 2, generator=g)}
    for i in range(4):
        out[f"layers.{i}.gate_proj.weight"] = torch.randn(4, 8, generator=g)
        out[f"layers.{i}.up_proj.weight"] = torch.randn(4, 8, generator=g)
        out[f"layers.{i}.down_proj.weight"] = torch.randn(8, 4, generator=g)
        out[f"layers.{i}.norm.weight"] = torch.randn(8, generator=g)
    return out


def write(folder, tensors, shards=1):
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return str(folder)
    weight_map = {}
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    return str(folder)


def test_complete_sharded_checkpoint_loads(tmp_path):
    tensors = checkpoint_tensors()
    model = TinyModel()
    report = load_weights(model, write(tmp_path, tensors, shards=2))
    assert len(report.loaded) == 12
    assert report.skipped_declared == ["vision_tower.patch.weight"]
    w = model.layers[2].gate_up_proj.weight
    assert torch.equal(w[:4], tensors["layers.2.gate_proj.weight"])
    assert torch.equal(w[4:], tensors["layers.2.up_proj.weight"])


def test_missing_tensor_is_named(tmp_path):
    tensors = checkpoint_tensors()
    del tensors["layers.1.up_proj.weight"]
    with pytest.raises(
        WeightLoadingError, match=r"layers\.1\.gate_up_proj\.weight \(shards \['1'\]\)"
    ):
        load_weights(TinyModel(), write(tmp_path, tensors))


def test_misshaped_tensor_names_both_shapes(tmp_path):
    tensors = checkpoint_tensors()
    tensors["layers.0.down_proj.weight"] = torch.zeros(8, 5)
    with pytest.raises(WeightLoadingError, match=r"\(8, 5\) vs parameter \(8, 4\)"):
        load_weights(TinyModel(), write(tmp_path, tensors))


def test_unaccounted_checkpoint_tensor_fails(tmp_path):
    tensors = checkpoint_tensors()
    tensors["layers.0.extra_proj.weight"] = torch.zeros(2)
    with pytest.raises(
        WeightLoadingError, match="no parameter: layers.0.extra_proj.weight"
    ):
        load_weights(TinyModel(), write(tmp_path, tensors))


def test_other_stage_tensors_are_skipped_not_dropped(tmp_path):
    folder = write(tmp_path, checkpoint_tensors())
    with build_parallel_state(pp_rank=1, pp_size=2):
        model = TinyModel()
        report = load_weights(model, folder)
    assert report.skipped_other_stage == 8  # layers 0-1 live on stage 0
    assert report.loaded == {n for n, _ in model.named_parameters()}
    assert "pp_rank 1" in report.stage


def load_on_rank(rank, folder):
    tensors = checkpoint_tensors()
    model = TinyModel()
    try:
        load_weights(model, folder)
    except WeightLoadingError as err:
        return str(err)
    full = tensors["layers.3.down_proj.weight"]
    return torch.equal(
        model.layers[3].down_proj.weight, full[:, rank * 2 : rank * 2 + 2]
    )


def test_tensor_parallel_loading(tmp_path):
    good = write(tmp_path / "good", checkpoint_tensors())
    assert run_ranks(load_on_rank, tp_size=2, args=(good,)) == [True, True]
    tensors = checkpoint_tensors()
    del tensors["layers.3.norm.weight"]
    bad = write(tmp_path / "bad", tensors)
    messages = run_ranks(load_on_rank, tp_size=2, args=(bad,))
    assert all("parameter never loaded: layers.3.norm.weight" in m for m in messages)
    assert "tp_rank 1" in messages[1]
