"""Writers of the tiny checkpoint folders: config, safetensors, tokenizer, generation.

| name | layout | weights |
|---|---|---|
| tiny-kimi-linear | flat `model.*` / `lm_head.*`, one file | `trained/tiny-kimi-linear` |
| tiny-kimi-k3 | `language_model.*` + stub vision, two shards with an index | `trained/tiny-kimi-k3` |
| tiny-kimi-k31 | as K3, `KimiK31ForConditionalGeneration` | `trained/tiny-kimi-k3` |
| tiny-kimi-k3-dspark | draft plus a copy of tiny-kimi-k3's embedding | `trained/tiny-kimi-k3-dspark` |
| tiny-kimi-k31-dspark | the same draft without `embed_tokens` | `trained/tiny-kimi-k3-dspark` |

The shipped weights (`trained/<name>.safetensors`, bf16, written by
`python -m tools.train_tiny`, see docs/tiny_models.md) are language models trained
on the tiny corpus and a DSpark draft distilled from the K3 target; checkpoints hold
them as float32. Training starts from `initial_tensors`, the seeded init of
`weights.py`; the untrained parts (stub vision tensors, the draft's confidence
head) keep those values.
"""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from atom.models.tiny import configs, weights
from atom.models.tiny.tokenizer import build_tokenizer

KIMI_LINEAR_SEED, K3_SEED, K3_DRAFT_SEED = 11, 3, 103
K3_TARGET_EMBED_NAME = "language_model.model.embed_tokens.weight"
DRAFT_EMBED_NAME = "embed_tokens.weight"
TRAINED_DIR = Path(__file__).parent / "trained"
# The shipped weight files: the K3.1 pair reuses the K3 pair's.
TRAINED_FILES = ("tiny-kimi-linear", "tiny-kimi-k3", "tiny-kimi-k3-dspark")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_sharded(
    tensors: dict[str, torch.Tensor], out: Path, first: set[str]
) -> None:
    """Two shards plus `model.safetensors.index.json`; `first` names go to shard 1."""
    shards = [
        {k: v for k, v in tensors.items() if k in first},
        {k: v for k, v in tensors.items() if k not in first},
    ]
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, out / file_name)
        weight_map.update({name: file_name for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(out / "model.safetensors.index.json", index)


def _write_common(out: Path, config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", configs.generation_config())
    build_tokenizer(out)


def _conform(
    specs: list[weights.TensorSpec], tensors: dict[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """`tensors` as float32 in spec order, after checking names and shapes."""
    expected = {spec.name: spec.shape for spec in specs}
    missing, extra = sorted(expected.keys() - tensors), sorted(
        tensors - expected.keys()
    )
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


def kimi_linear_specs() -> list[weights.TensorSpec]:
    return weights.kimi_linear_specs(configs.kimi_linear_config())


def k3_specs() -> list[weights.TensorSpec]:
    return weights.k3_specs(configs.k3_config("KimiK3ForConditionalGeneration"))


def dspark_specs() -> list[weights.TensorSpec]:
    """The draft's own tensors (no `embed_tokens`)."""
    config = configs.dspark_config(configs.k3_text_config())
    return weights.dspark_specs(config, with_embedding=False)


_SPECS_AND_SEEDS = {
    "tiny-kimi-linear": (kimi_linear_specs, KIMI_LINEAR_SEED),
    "tiny-kimi-k3": (k3_specs, K3_SEED),
    "tiny-kimi-k3-dspark": (dspark_specs, K3_DRAFT_SEED),
}


def initial_tensors(name: str) -> dict[str, torch.Tensor]:
    """The seeded init of a trained file's tensors (where training starts)."""
    if name not in _SPECS_AND_SEEDS:
        raise ValueError(
            f"no weights named {name!r}; known: {', '.join(TRAINED_FILES)}"
        )
    specs, seed = _SPECS_AND_SEEDS[name]
    return weights.materialize(specs(), seed)


def trained_path(name: str) -> Path:
    return TRAINED_DIR / f"{name}.safetensors"


def trained_tensors(name: str) -> dict[str, torch.Tensor]:
    """The shipped trained weights of `name` (one of TRAINED_FILES), float32."""
    if name not in _SPECS_AND_SEEDS:
        raise ValueError(
            f"no weights named {name!r}; known: {', '.join(TRAINED_FILES)}"
        )
    specs, _ = _SPECS_AND_SEEDS[name]
    return _conform(
        specs(), load_file(str(trained_path(name))), str(trained_path(name))
    )


def write_kimi_linear(out_dir: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    out = Path(out_dir)
    _write_common(out, configs.kimi_linear_config())
    _save(
        _conform(kimi_linear_specs(), tensors, "tiny-kimi-linear"),
        out / "model.safetensors",
    )


def write_k3_layout(
    out_dir: str | Path, architecture: str, tensors: dict[str, torch.Tensor]
) -> None:
    out = Path(out_dir)
    config = configs.k3_config(architecture)
    _write_common(out, config)
    tensors = _conform(k3_specs(), tensors, architecture)
    # Shard 1 holds vision, the embedding and the first half of the layers.
    half = config["text_config"]["num_hidden_layers"] // 2
    first_half = tuple(f"language_model.model.layers.{i}." for i in range(half))
    first = {
        name
        for name in tensors
        if not name.startswith("language_model.")
        or name == K3_TARGET_EMBED_NAME
        or name.startswith(first_half)
    }
    _write_sharded(tensors, out, first)


def write_dspark_draft(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    embedding: torch.Tensor | None,
) -> None:
    """A draft folder: its own tensors, plus `embed_tokens` when `embedding` is
    given (a copy of the target's table, which atom never loads)."""
    out = Path(out_dir)
    _write_common(out, configs.dspark_config(configs.k3_text_config()))
    tensors = _conform(dspark_specs(), tensors, "tiny DSpark draft")
    if embedding is not None:
        tensors[DRAFT_EMBED_NAME] = embedding.float().contiguous()
    _save(tensors, out / "model.safetensors")


def build_kimi_linear(out_dir: str | Path) -> None:
    write_kimi_linear(out_dir, trained_tensors("tiny-kimi-linear"))


def build_k3(out_dir: str | Path) -> None:
    write_k3_layout(
        out_dir, "KimiK3ForConditionalGeneration", trained_tensors("tiny-kimi-k3")
    )


def build_k31(out_dir: str | Path) -> None:
    """The K3 weights under the K3.1 architecture name (the same stack)."""
    write_k3_layout(
        out_dir, "KimiK31ForConditionalGeneration", trained_tensors("tiny-kimi-k3")
    )


def build_k3_dspark(out_dir: str | Path) -> None:
    """The draft distilled from tiny-kimi-k3, shipping a copy of its embedding."""
    embedding = trained_tensors("tiny-kimi-k3")[K3_TARGET_EMBED_NAME]
    write_dspark_draft(out_dir, trained_tensors("tiny-kimi-k3-dspark"), embedding)


def build_k31_dspark(out_dir: str | Path) -> None:
    """The same draft without `embed_tokens`, as Inferact's K3.1 draft."""
    write_dspark_draft(out_dir, trained_tensors("tiny-kimi-k3-dspark"), None)


BUILDERS: dict[str, Callable[[str | Path], None]] = {
    "tiny-kimi-linear": build_kimi_linear,
    "tiny-kimi-k3": build_k3,
    "tiny-kimi-k31": build_k31,
    "tiny-kimi-k3-dspark": build_k3_dspark,
    "tiny-kimi-k31-dspark": build_k31_dspark,
}
