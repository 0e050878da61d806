"""KV cache scales a checkpoint ships: one per attention layer, set at load.

fp8 checkpoints (vLLM's convention) carry scalars `<attention>.k_scale` and
`<attention>.v_scale`, or one `<attention>.kv_scale`, beside an attention module's
weights, meaning stored = value / scale. atom stores a layer's whole row ([k | v],
an MLA latent, a draft's context row) with one scale (`PagedKVLayer.kv_scale`,
`model_ops/paged_cache.py`), so a layer takes the largest scale given for it: no part
of the row then clips that its own scale would have kept. Layers the checkpoint
gives no scale keep `DEFAULT_KV_SCALE`. The scales are not parameters: the strict
loader hands them here and refuses one that names no paged-cache layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from atom.models.interfaces import PagedKVLayer

KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")
# A checkpoint's attention prefix maps onto atom's module the way its output
# projection's name does (every paged-cache attention has one).
_PROBE = ".o_proj.weight"


def kv_scale_layer(name: str) -> str | None:
    """The checkpoint prefix of the layer a KV scale tensor belongs to (None: `name`
    is no KV scale)."""
    for suffix in KV_SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return None


def scale_value(name: str, tensor: torch.Tensor) -> float:
    """The scale a tensor holds; refuses anything but one positive finite number."""
    if tensor.numel() != 1:
        raise ValueError(
            f"KV scale {name!r} has shape {tuple(tensor.shape)}; one value per layer "
            "is supported"
        )
    value = float(tensor.float().item())
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"KV scale {name!r} is {value}; it must be positive")
    return value


class KVScales:
    """The scales seen while loading `model`, applied once loading is done."""

    def __init__(self, model: nn.Module, map_name) -> None:
        self.model = model
        self.map_name = map_name  # the loader's checkpoint-name mapping
        self.largest: dict[str, float] = {}  # atom module path -> scale

    def module_path(self, prefix: str) -> str:
        modules = dict(self.model.named_modules())
        if prefix in modules:
            return prefix
        mapped = self.map_name(self.model, prefix + _PROBE)
        if mapped is not None and mapped[0].endswith(_PROBE):
            return mapped[0].removesuffix(_PROBE)
        return prefix

    def record(self, name: str, tensor: torch.Tensor) -> None:
        path = self.module_path(kv_scale_layer(name))
        value = scale_value(name, tensor)
        self.largest[path] = max(value, self.largest.get(path, 0.0))

    def apply(self) -> list[str]:
        """Set every recorded layer's scale; the problems, for the loader to raise."""
        modules = dict(self.model.named_modules())
        problems = []
        for path, value in sorted(self.largest.items()):
            layer = modules.get(path)
            if not isinstance(layer, PagedKVLayer):
                problems.append(f"KV scale for {path!r}, which is no paged-cache layer")
                continue
            layer.kv_scale = value
        return problems
