"""Read HF safetensors checkpoints, one file or sharded with an index."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, shard) for shard in shards]
    files = sorted(
        os.path.join(model_dir, name)
        for name in os.listdir(model_dir)
        if name.endswith(".safetensors")
    )
    if not files:
        raise ValueError(f"no .safetensors files in {model_dir!r}")
    return files


def iterate_tensors(
    model_dir: str, wanted: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield (name, tensor) for wanted names and (name, None) for the rest.

    Unwanted tensors are never read: only the shard header is parsed.
    """
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, (f.get_tensor(name) if wanted(name) else None)
