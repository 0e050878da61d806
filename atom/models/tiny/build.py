"""Writers of the tiny checkpoint folders: config, safetensors, tokenizer, generation.

| name | layout | seed |
|---|---|---|
| tiny-kimi-linear | flat `model.*` / `lm_head.*`, one file | 11 |
| tiny-kimi-k3 | `language_model.*` + stub vision, two shards with an index | 3 |
| tiny-kimi-k31 | as K3, `KimiK31ForConditionalGeneration` | 31 |
| tiny-kimi-k3-dspark | draft with an `embed_tokens` copy of tiny-kimi-k3's table | 103 |
| tiny-kimi-k31-dspark | draft without `embed_tokens` | 131 |
"""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from atom.models.tiny import configs, weights
from atom.models.tiny.tokenizer import build_tokenizer

KIMI_LINEAR_SEED, K3_SEED, K31_SEED = 11, 3, 31
K3_DRAFT_SEED, K31_DRAFT_SEED = 103, 131
K3_TARGET_EMBED_NAME = "language_model.model.embed_tokens.weight"


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
    build_tokenizer(out, configs.TINY_VOCAB_SIZE)


def build_kimi_linear(out_dir: str | Path) -> None:
    out = Path(out_dir)
    config = configs.kimi_linear_config()
    _write_common(out, config)
    tensors = weights.materialize(weights.kimi_linear_specs(config), KIMI_LINEAR_SEED)
    _save(tensors, out / "model.safetensors")


def _build_k3_layout(out_dir: str | Path, architecture: str, seed: int) -> None:
    out = Path(out_dir)
    config = configs.k3_config(architecture)
    _write_common(out, config)
    tensors = weights.materialize(weights.k3_specs(config), seed)
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


def build_k3(out_dir: str | Path) -> None:
    _build_k3_layout(out_dir, "KimiK3ForConditionalGeneration", K3_SEED)


def build_k31(out_dir: str | Path) -> None:
    _build_k3_layout(out_dir, "KimiK31ForConditionalGeneration", K31_SEED)


def _build_dspark(
    out_dir: str | Path, seed: int, embedding_of_seed: int | None
) -> None:
    out = Path(out_dir)
    config = configs.dspark_config(configs.k3_text_config())
    _write_common(out, config)
    with_embedding = embedding_of_seed is not None
    specs = weights.dspark_specs(config, with_embedding=with_embedding)
    copies = {"embed_tokens.weight": (K3_TARGET_EMBED_NAME, embedding_of_seed)}
    tensors = weights.materialize(specs, seed, copies if with_embedding else None)
    _save(tensors, out / "model.safetensors")


def build_k3_dspark(out_dir: str | Path) -> None:
    """K3 draft: ships a copy of tiny-kimi-k3's embedding, which atom must skip."""
    _build_dspark(out_dir, K3_DRAFT_SEED, embedding_of_seed=K3_SEED)


def build_k31_dspark(out_dir: str | Path) -> None:
    """K3.1 draft: no `embed_tokens`, as Inferact/Kimi-K3.1-DSpark."""
    _build_dspark(out_dir, K31_DRAFT_SEED, embedding_of_seed=None)


BUILDERS: dict[str, Callable[[str | Path], None]] = {
    "tiny-kimi-linear": build_kimi_linear,
    "tiny-kimi-k3": build_k3,
    "tiny-kimi-k31": build_k31,
    "tiny-kimi-k3-dspark": build_k3_dspark,
    "tiny-kimi-k31-dspark": build_k31_dspark,
}
