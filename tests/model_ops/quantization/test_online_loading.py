"""ptpc_fp8 through the strict loader on tiny-kimi-k3: which modules turn fp8, that
every scale is accounted for and filled, and that a missing weight is still refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom.config import Config
from atom.model_loader.build import load_target
from atom.model_loader.loader import WeightLoadingError
from atom.model_ops.linear import LinearBase
from atom.model_ops.quantization.apply import full_precision_names
from atom.model_ops.quantization.ptpc_fp8 import FP8_DTYPE, quantize_rows
from atom.model_ops.routed_experts import FusedExperts
from atom.models.tiny import resolve_model_path

PTPC = '{"global_quant_config": "ptpc_fp8"}'
DENSE = "language_model.model.layers.0.mlp.down_proj"


def load(model: str) -> tuple[torch.nn.Module, object]:
    config = Config(model=model, device="cpu", online_quant_config=PTPC)
    return load_target(config, "cpu")


@pytest.fixture(scope="module")
def loaded():
    return load(resolve_model_path("tiny-kimi-k3"))


def test_linears_and_experts_load_as_fp8_and_the_rest_in_the_model_dtype(loaded):
    model, report = loaded
    keep = full_precision_names(model)
    assert {"kv_b_proj", "b_proj"} <= keep
    quantized = []
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            assert module.w13.dtype == module.w2.dtype == FP8_DTYPE, name
            assert (module.w13_scale > 0).all() and (module.w2_scale > 0).all()
            quantized.append(name)
        elif isinstance(module, LinearBase):
            fp8 = name.rsplit(".", 1)[-1] not in keep
            assert (module.weight.dtype == FP8_DTYPE) == fp8, name
            assert hasattr(module, "weight_scale") == fp8, name
            quantized += [name] if fp8 else []
    kinds = {name.rsplit(".", 1)[-1] for name in quantized}
    assert {"in_proj", "o_proj", "gate_up_proj", "down_proj", "experts"} <= kinds
    params = dict(model.named_parameters())
    for name in ("embed_tokens.weight", "lm_head.weight", "gate.weight", "norm.weight"):
        matches = [p for n, p in params.items() if n.endswith(name)]
        assert matches and all(p.dtype == torch.float32 for p in matches), name
    # Every parameter, scales included, is accounted for.
    assert report.loaded == set(params)
    assert f"{DENSE}.weight_scale" in report.loaded


def test_scales_are_those_of_the_checkpoint_weights(loaded):
    model, _ = loaded
    folder = Path(resolve_model_path("tiny-kimi-k3"))
    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(path))
    layer = model.get_submodule(DENSE)
    codes, scale = quantize_rows(tensors[f"{DENSE}.weight"])
    assert torch.equal(layer.weight_scale, scale)
    assert torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8))


def test_a_missing_weight_is_refused_with_its_scale(tmp_path):
    source = Path(resolve_model_path("tiny-kimi-k3"))
    folder = tmp_path / "m"
    shutil.copytree(source, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    file_name = index["weight_map"].pop(f"{DENSE}.weight")
    tensors = load_file(folder / file_name)
    del tensors[f"{DENSE}.weight"]
    save_file(tensors, folder / file_name)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadingError) as err:
        load(str(folder))
    assert f"parameter never loaded: {DENSE}.weight" in str(err.value)
    assert f"{DENSE}.weight_scale has no loaded {DENSE}.weight" in str(err.value)
