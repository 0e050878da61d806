"""Writers of the tiny checkpoint folders: config, safetensors, tokenizer, generation.

| name | layout | weights |
|---|---|---|
| tiny-kimi-linear | flat `model.*` / `lm_head.*`, one file | `trained/tiny-kimi-linear` |
| tiny-kimi-k3 | `language_model.*` + stub vision, two shards with an index | `trained/tiny-kimi-k3` |
| tiny-kimi-k31 | as K3, `KimiK31ForConditionalGeneration` | `trained/tiny-kimi-k3` |
| tiny-kimi-k3-dspark | draft plus a copy of tiny-kimi-k3's embedding | `trained/tiny-kimi-k3-dspark` |
| tiny-kimi-k31-dspark | the same draft without `embed_tokens` | `trained/tiny-kimi-k3-dspark` |

The shipped weights (`trained.py`) are language models trained on the tiny corpus
and a DSpark draft distilled from the K3 target; checkpoints hold them as float32.
"""

from collections.abc import Callable
from pathlib import Path

import torch

from atom.models.tiny import configs
from atom.models.tiny.folder import save_tensors, write_common, write_json
from atom.models.tiny.trained import conform_to, trained_tensors

K3_ARCH = "KimiK3ForConditionalGeneration"
K3_TARGET_EMBED_NAME = "language_model.model.embed_tokens.weight"
DRAFT_EMBED_NAME = "embed_tokens.weight"


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
        save_tensors(shard, out / file_name)
        weight_map.update({name: file_name for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_json(out / "model.safetensors.index.json", index)


def write_kimi_linear(out_dir: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    out = Path(out_dir)
    write_common(out, configs.kimi_linear_config())
    save_tensors(conform_to("tiny-kimi-linear", tensors), out / "model.safetensors")


def write_k3_layout(
    out_dir: str | Path, architecture: str, tensors: dict[str, torch.Tensor]
) -> None:
    out = Path(out_dir)
    config = configs.k3_config(architecture)
    write_common(out, config)
    tensors = conform_to("tiny-kimi-k3", tensors)
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
    write_common(out, configs.dspark_config(configs.k3_text_config()))
    tensors = conform_to("tiny-kimi-k3-dspark", tensors)
    if embedding is not None:
        tensors[DRAFT_EMBED_NAME] = embedding.float().contiguous()
    save_tensors(tensors, out / "model.safetensors")


def build_kimi_linear(out_dir: str | Path) -> None:
    write_kimi_linear(out_dir, trained_tensors("tiny-kimi-linear"))


def build_k3(out_dir: str | Path) -> None:
    write_k3_layout(out_dir, K3_ARCH, trained_tensors("tiny-kimi-k3"))


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
