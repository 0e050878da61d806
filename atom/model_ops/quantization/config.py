"""What is quantized, parsed once: the online scheme and the checkpoint's declaration.

Two sources decide how a linear or expert module stores its weights:

- the checkpoint's `quantization_config` (compressed-tensors), which today declares
  MXFP4 routed experts (`mxfp4.py`); those modules load the checkpoint's form;
- the online config (`--online_quant_config`, ATOM's JSON), which quantizes the
  model-dtype weights of every other linear and expert module at load time.

This module reads only plain data (no torch, no layers), so `Config` can parse and
refuse a bad flag before any model code loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from atom.utils.json_flag import json_object

ONLINE_FLAG = "--online_quant_config"
# Per-output-channel fp8 e4m3 weights, per-token fp8 activations (`ptpc_fp8.py`).
PTPC_FP8 = "ptpc_fp8"
ONLINE_SCHEMES = (PTPC_FP8,)
# The keys of ATOM's online config that atom reads; any other is refused, not ignored.
ONLINE_KEYS = ("global_quant_config",)


def _online_mapping(online: str | Mapping | None) -> Mapping:
    if online is None or online == "":
        return {}
    return json_object(
        online, ONLINE_FLAG, f'\'{{"global_quant_config": "{PTPC_FP8}"}}\''
    )


def parse_online_scheme(online: str | Mapping | None) -> str | None:
    """The scheme the online config names (None when it names none), or a
    ValueError naming the flag and the supported values."""
    mapping = _online_mapping(online)
    unknown = sorted(set(mapping) - set(ONLINE_KEYS))
    if unknown:
        raise ValueError(
            f"{ONLINE_FLAG}: unsupported keys {unknown}; supported: "
            f"{', '.join(ONLINE_KEYS)}"
        )
    scheme = mapping.get("global_quant_config")
    if scheme is None:
        return None
    if scheme not in ONLINE_SCHEMES:
        raise ValueError(
            f"{ONLINE_FLAG}: unknown global_quant_config {scheme!r}; supported: "
            f"{', '.join(ONLINE_SCHEMES)}"
        )
    return scheme


@dataclass(frozen=True)
class QuantizationConfig:
    """The resolved quantization of one model: `online_scheme` (None: weights stay
    in the model dtype) and the checkpoint's `quantization_config` as written."""

    online_scheme: str | None = None
    checkpoint: Mapping[str, Any] | None = None

    @classmethod
    def parse(
        cls, online: str | Mapping | None, checkpoint: Mapping | None
    ) -> QuantizationConfig:
        if checkpoint is not None and not isinstance(checkpoint, Mapping):
            raise TypeError(
                "quantization_config must be a mapping, got "
                f"{type(checkpoint).__name__}"
            )
        return cls(parse_online_scheme(online), checkpoint)

    def describe(self) -> str:
        """For the start-up log."""
        return f"online quantization {self.online_scheme or 'none'}"
