"""The shipped trained weights: where each file lives, its tensors and its seeded init.

`trained/<name>.safetensors` (bf16, checkpoint names) are written by
`python -m tools.train_tiny` (docs/tiny_models.md) and read here as float32 after
checking them against the config's manifest; training starts from `initial_tensors`,
the seeded init of `weights.py`, and the untrained parts (stub vision tensors, a
draft's confidence head) keep those values. Aliased releases (K3.1, M3.1) and the
drafts' embedding copies reuse these files; the builders decide.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file

from atom.models.tiny import configs, minimax_specs, weights
from atom.models.tiny.folder import conform

TRAINED_DIR = Path(__file__).parent / "trained"
KIMI_LINEAR_SEED, K3_SEED, K3_DRAFT_SEED = 11, 3, 103


class TrainedFile(NamedTuple):
    specs: Callable[[], list[weights.TensorSpec]]
    initial: Callable[[], dict[str, torch.Tensor]]


def kimi_linear_specs() -> list[weights.TensorSpec]:
    return weights.kimi_linear_specs(configs.kimi_linear_config())


def k3_specs() -> list[weights.TensorSpec]:
    return weights.k3_specs(configs.k3_config("KimiK3ForConditionalGeneration"))


def k3_dspark_specs() -> list[weights.TensorSpec]:
    """The K3 draft's own tensors (no `embed_tokens`)."""
    config = configs.dspark_config(configs.k3_text_config())
    return weights.dspark_specs(config, with_embedding=False)


def _seeded(specs: Callable[[], list[weights.TensorSpec]], seed: int):
    return lambda: weights.materialize(specs(), seed)


TRAINED_FILES: dict[str, TrainedFile] = {
    "tiny-kimi-linear": TrainedFile(
        kimi_linear_specs, _seeded(kimi_linear_specs, KIMI_LINEAR_SEED)
    ),
    "tiny-kimi-k3": TrainedFile(k3_specs, _seeded(k3_specs, K3_SEED)),
    "tiny-kimi-k3-dspark": TrainedFile(
        k3_dspark_specs, _seeded(k3_dspark_specs, K3_DRAFT_SEED)
    ),
    "tiny-minimax-m3": TrainedFile(
        minimax_specs.target_specs, minimax_specs.initial_target
    ),
    "tiny-minimax-m3-dspark": TrainedFile(
        minimax_specs.draft_specs, minimax_specs.initial_draft
    ),
}


def _entry(name: str) -> TrainedFile:
    if name not in TRAINED_FILES:
        raise ValueError(
            f"no weights named {name!r}; known: {', '.join(TRAINED_FILES)}"
        )
    return TRAINED_FILES[name]


def initial_tensors(name: str) -> dict[str, torch.Tensor]:
    """The seeded init of a trained file's tensors (where training starts)."""
    return _entry(name).initial()


def trained_path(name: str) -> Path:
    return TRAINED_DIR / f"{name}.safetensors"


def trained_tensors(name: str) -> dict[str, torch.Tensor]:
    """The shipped trained weights of `name` (one of TRAINED_FILES), float32."""
    path = trained_path(name)
    return conform(_entry(name).specs(), load_file(str(path)), str(path))


def conform_to(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` checked against `name`'s manifest, float32 in manifest order."""
    return conform(_entry(name).specs(), tensors, name)
