"""Writing a tiny checkpoint folder: config, tokenizer, generation config, tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from atom.models.tiny import configs
from atom.models.tiny.tokenizer import build_tokenizer
from atom.models.tiny.weights import TensorSpec


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_common(out: Path, config: dict) -> None:
    """The folder with `config`, the generation config and the tiny tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", configs.generation_config())
    build_tokenizer(out)


def conform(
    specs: list[TensorSpec], tensors: dict[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """`tensors` as float32 in spec order, after checking names and shapes."""
    expected = {spec.name: spec.shape for spec in specs}
    missing = sorted(expected.keys() - tensors)
    extra = sorted(tensors - expected.keys())
    if missing or extra:
        raise ValueError(
            f"{what} does not fit its config: missing {missing[:5]}, extra {extra[:5]}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{what}: {name} has shape {tuple(tensors[name].shape)}, the config "
                f"needs {shape}"
            )
    return {name: tensors[name].float().contiguous() for name in expected}
