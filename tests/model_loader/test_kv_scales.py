"""KV cache scales from the checkpoint: k_scale / v_scale / kv_scale set each layer's
row scale (the largest of a layer's), and bad ones are refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom.model_engine.llm_engine import LLMEngine
from atom.model_loader.loader import WeightLoadingError
from atom.model_ops.paged_cache import DEFAULT_KV_SCALE
from atom.models.tiny import resolve_model_path
from atom.sampling_params import SamplingParams
from tools import fit_draft
from tools.prefill import load_model

pytestmark = pytest.mark.usefixtures("single_thread_torch")

TARGET, DRAFT = "tiny-minimax-m3", "tiny-minimax-m3-dspark"
LAYER = "language_model.model.layers.{}.self_attn"


def with_tensors(source: str, out: Path, extra: dict[str, torch.Tensor]) -> str:
    """A copy of the single-file checkpoint `source` with `extra` tensors added."""
    shutil.copytree(resolve_model_path(source), out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, **extra}, str(out / "model.safetensors"))
    return str(out)


def scale(value: float) -> torch.Tensor:
    return torch.tensor(value)


def kv_scales(model: torch.nn.Module) -> dict[str, float]:
    return {
        name: module.kv_scale
        for name, module in model.named_modules()
        if hasattr(module, "kv_scale")
    }


def test_a_layer_takes_the_largest_of_its_scales(tmp_path):
    folder = with_tensors(TARGET, tmp_path / "m3", {
        f"{LAYER.format(2)}.k_scale": scale(0.5),
        f"{LAYER.format(2)}.v_scale": scale(2.0),
        f"{LAYER.format(4)}.kv_scale": scale(0.25),
    })  # fmt: skip
    model, _ = load_model(folder)
    scales = kv_scales(model)
    assert scales.pop(LAYER.format(2)) == 2.0
    assert scales.pop(LAYER.format(4)) == 0.25
    assert set(scales.values()) == {DEFAULT_KV_SCALE}  # layers without one


def test_a_draft_takes_its_scales_under_either_prefix(tmp_path):
    target, config = load_model(TARGET)
    folder = with_tensors(DRAFT, tmp_path / "draft", {
        "model.layers.0.self_attn.k_scale": scale(3.0),
        "layers.1.self_attn.kv_scale": scale(0.5),
    })  # fmt: skip
    draft = fit_draft.load_draft(folder, target, config)
    assert kv_scales(draft) == {"layers.0.self_attn": 3.0, "layers.1.self_attn": 0.5}


def test_fp8_rows_are_stored_with_the_checkpoint_scale(tmp_path):
    """Unit scales in the checkpoint decode exactly as the default; larger ones
    store coarser rows, so greedy decoding may move but still runs."""
    prompts = [[(37 * i + 11) % 1000 for i in range(20)]]
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def ids(folder: str) -> list[int]:
        engine = LLMEngine(folder, device="cpu", kv_cache_dtype="fp8", max_num_seqs=1)
        try:
            return engine.generate(prompts, params)[0]["token_ids"]
        finally:
            engine.close()

    layers = [LAYER.format(i) for i in range(6)]
    unit = with_tensors(TARGET, tmp_path / "unit", {
        f"{layer}.kv_scale": scale(1.0) for layer in layers})  # fmt: skip
    assert ids(unit) == ids(resolve_model_path(TARGET))
    engine = LLMEngine(
        with_tensors(TARGET, tmp_path / "coarse", {
            f"{layer}.kv_scale": scale(64.0) for layer in layers}),
        device="cpu", kv_cache_dtype="fp8", max_num_seqs=1,
    )  # fmt: skip
    try:
        engine.generate(prompts, params)
        layer_scales = engine.workers.call(_first_layer_scale)
    finally:
        engine.close()
    assert layer_scales == [64.0]


def _first_layer_scale(runner) -> float:
    model = runner.model
    return dict(model.named_modules())[LAYER.format(0)].kv_scale


@pytest.mark.parametrize(
    "name, value, message",
    [
        (f"{LAYER.format(2)}.k_scale", torch.ones(4), "one value per layer"),
        (f"{LAYER.format(2)}.v_scale", scale(-1.0), "must be positive"),
        (f"{LAYER.format(2)}.kv_scale", scale(float("nan")), "must be positive"),
        ("language_model.model.layers.2.mlp.k_scale", scale(1.0), "no paged-cache"),
    ],
)
def test_bad_scales_are_refused_by_name(tmp_path, name, value, message):
    folder = with_tensors(TARGET, tmp_path / "bad", {name: value})
    with pytest.raises(WeightLoadingError, match=message):
        load_model(folder)
