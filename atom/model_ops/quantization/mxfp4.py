"""MXFP4 weights: the e2m1 + e8m0 codec and the compressed-tensors declaration.

Kimi-K3 ships its routed experts as compressed-tensors `mxfp4-pack-quantized`:
`.weight_packed` uint8 [out, in/2] and `.weight_scale` uint8 [out, in/32]. atom
dequantizes them once at load time; the forward never sees packed bytes.

Format facts this module relies on (checked against the sources named):
- e2m1 nibble: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is
  subnormal. Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no Inf or NaN codes. Source: the
  `FLOAT_TO_E2M1` table and "sign bit (bit 3)" of compressed-tensors
  `compressors/nvfp4/helpers.py`, whose packer the MXFP4 compressor
  (`compressors/mxfp4/base.py`) inherits.
- Nibble order: element 2k sits in the LOW nibble, element 2k+1 in the HIGH nibble
  (`pack_fp4_to_uint8` ORs the first of each pair with the second shifted by 4).
- e8m0 scale byte s means 2^(s - 127) (compressed-tensors `mx_utils.py`
  `decompress_mx_scale`); 0..254 span 2^-127..2^127 and 0xFF is NaN (NVIDIA CUDA
  math API `__nv_fp8_e8m0`, following OCP MX v1.0).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

MXFP4_FORMAT = "mxfp4-pack-quantized"
MXFP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# Indexed by the 4-bit code: codes 8..15 are the negatives of 0..7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _code_table() -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([magnitudes, -magnitudes])


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) as fp32, exactly: the byte is written straight into the exponent
    field (s = 0, below fp32's normal range, is the subnormal 2^-127)."""
    biased = scale.to(torch.int32)
    bits = torch.where(biased == 0, torch.full_like(biased, 1 << 22), biased << 23)
    value = bits.view(torch.float32)
    return value.masked_fill(biased == E8M0_NAN, float("nan"))


def _as_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 weight_scale must be uint8 (e8m0), got {scale.dtype}")
    return scale


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """[out, in] weight of `packed` uint8 [out, in/2] and `scale` e8m0 [out, in/32]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"MXFP4 weight_packed must be uint8, got {packed.dtype}")
    scale = _as_scale_bytes(scale)
    if packed.dim() != 2:
        raise ValueError(f"MXFP4 weight_packed must be 2-D, got {tuple(packed.shape)}")
    rows, half = packed.shape
    inner = 2 * half
    if inner % MXFP4_BLOCK:
        raise ValueError(
            f"MXFP4 input width {inner} is not a multiple of the block {MXFP4_BLOCK}"
        )
    if tuple(scale.shape) != (rows, inner // MXFP4_BLOCK):
        raise ValueError(
            f"MXFP4 weight_scale {tuple(scale.shape)} does not match weight_packed "
            f"{tuple(packed.shape)}: expected {(rows, inner // MXFP4_BLOCK)}"
        )
    nan_scales = int((scale == E8M0_NAN).sum())
    if nan_scales:
        raise ValueError(f"MXFP4 weight_scale holds {nan_scales} NaN (0xFF) bytes")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, inner)
    values = _code_table()[codes.long()].view(rows, -1, MXFP4_BLOCK)
    # An e2m1 value times a power of two is exact in fp32; so is the cast to bf16.
    weight = values * e8m0_to_float(scale).unsqueeze(-1)
    return weight.reshape(rows, inner).to(dtype)


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors target syntax: `re:<regex>`, a class name, or a module."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if "." not in pattern and pattern[:1].isupper():
        # Class targets: the routed-expert projections are Linear layers.
        return pattern == "Linear"
    return name == pattern


def _check_mxfp4_weights(group: str, weights: Any) -> None:
    if not isinstance(weights, Mapping):
        return
    expected = {"num_bits": 4, "group_size": MXFP4_BLOCK, "type": "float"}
    for key, value in expected.items():
        if key in weights and weights[key] != value:
            raise ValueError(
                f"quantization_config group {group!r} declares {MXFP4_FORMAT} with "
                f"weights.{key}={weights[key]!r}; MXFP4 needs {value!r}"
            )


def declares_mxfp4(quantization_config: Mapping | None, module: str) -> bool:
    """Whether a compressed-tensors `quantization_config` stores `module` (a Linear,
    e.g. `...experts.0.w1`) as MXFP4: not ignored, and its group's format is
    `mxfp4-pack-quantized` (group format, else the top-level one)."""
    if not quantization_config:
        return False
    if not isinstance(quantization_config, Mapping):
        raise TypeError(
            "quantization_config must be a mapping, got "
            f"{type(quantization_config).__name__}"
        )
    method = quantization_config.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        return False
    if any(_matches(module, p) for p in quantization_config.get("ignore") or ()):
        return False
    top_format = quantization_config.get("format")
    groups = quantization_config.get("config_groups") or {}
    if not groups:
        return top_format == MXFP4_FORMAT
    for group_name, group in groups.items():
        targets = group.get("targets") or ()
        if not any(_matches(module, t) for t in targets):
            continue
        if (group.get("format") or top_format) == MXFP4_FORMAT:
            _check_mxfp4_weights(group_name, group.get("weights"))
            return True
    return False
