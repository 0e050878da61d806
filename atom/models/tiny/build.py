"""Writers of the tiny checkpoint folders: config, safetensors, tokenizer, generation.

| name | layout | seed |
|---|---|---|
| tiny-kimi-linear | flat `model.*` / `lm_head.*`, one file | 11 |
| tiny-kimi-k3 | `language_model.*` + stub vision, two shards with an index | 3 |
| tiny-kimi-k31 | as K3, `KimiK31ForConditionalGeneration` | 31 |
| tiny-kimi-k3-dspark | draft with an `embed_tokens` copy of tiny-kimi-k3's table | 103 |
| tiny-kimi-k31-dspark | draft without `embed_tokens` | 131 |

The drafts' own weights come from `fitted/<name>.safetensors` (written by
`python -m atom.models.tiny.fit_draft`); the seed fills the rest (the confidence head).
"""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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


FITTED_DIR = Path(__file__).parent / "fitted"

# Draft name -> (seed of its random init, seed of the target whose embedding it
# copies, or None for a draft shipped without `embed_tokens`).
DRAFT_SEEDS: dict[str, tuple[int, int | None]] = {
    "tiny-kimi-k3-dspark": (K3_DRAFT_SEED, K3_SEED),
    "tiny-kimi-k31-dspark": (K31_DRAFT_SEED, None),
}


def fitted_draft_path(name: str) -> Path:
    """The shipped fitted weights of a tiny draft (see `fit_draft`)."""
    return FITTED_DIR / f"{name}.safetensors"


def _override(
    tensors: dict[str, torch.Tensor], fitted: dict[str, torch.Tensor]
) -> None:
    unknown = sorted(set(fitted) - set(tensors))
    if unknown:
        raise ValueError(f"fitted draft tensors {unknown} are not draft tensors")
    for name, value in fitted.items():
        if value.shape != tensors[name].shape:
            raise ValueError(
                f"fitted {name} has shape {tuple(value.shape)}, the draft "
                f"{tuple(tensors[name].shape)}"
            )
        tensors[name] = value.float().contiguous()


def build_dspark_draft(
    name: str, out_dir: str | Path, fitted: dict[str, torch.Tensor] | None
) -> None:
    """Write draft `name`: its seeded random init, with `fitted` tensors replacing
    the trained ones (None: the unfitted draft `fit_draft` starts from)."""
    if name not in DRAFT_SEEDS:
        raise ValueError(
            f"unknown tiny draft {name!r}; known: {', '.join(DRAFT_SEEDS)}"
        )
    seed, embedding_of_seed = DRAFT_SEEDS[name]
    out = Path(out_dir)
    config = configs.dspark_config(configs.k3_text_config())
    _write_common(out, config)
    with_embedding = embedding_of_seed is not None
    specs = weights.dspark_specs(config, with_embedding=with_embedding)
    copies = {"embed_tokens.weight": (K3_TARGET_EMBED_NAME, embedding_of_seed)}
    tensors = weights.materialize(specs, seed, copies if with_embedding else None)
    if fitted is not None:
        _override(tensors, fitted)
    _save(tensors, out / "model.safetensors")


def build_k3_dspark(out_dir: str | Path) -> None:
    """K3 draft fitted to tiny-kimi-k3; ships a copy of its embedding (atom skips it)."""
    name = "tiny-kimi-k3-dspark"
    build_dspark_draft(name, out_dir, load_file(fitted_draft_path(name)))


def build_k31_dspark(out_dir: str | Path) -> None:
    """K3.1 draft fitted to tiny-kimi-k31; no `embed_tokens`, as Inferact's."""
    name = "tiny-kimi-k31-dspark"
    build_dspark_draft(name, out_dir, load_file(fitted_draft_path(name)))


BUILDERS: dict[str, Callable[[str | Path], None]] = {
    "tiny-kimi-linear": build_kimi_linear,
    "tiny-kimi-k3": build_k3,
    "tiny-kimi-k31": build_k31,
    "tiny-kimi-k3-dspark": build_k3_dspark,
    "tiny-kimi-k31-dspark": build_k31_dspark,
}
