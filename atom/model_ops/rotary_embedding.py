"""Rotary position embedding, plain or YaRN-scaled (DeepSeek convention), and the
per-head norm-then-rotate of attention with q/k norms."""

from __future__ import annotations

import math

import torch
from torch import nn

from atom.model_ops.layernorm import RMSNorm, use_norm_kernel


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        # The rotary dimension whose wavelength fits `rotations` turns in `original`.
        return (
            dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    extrapolated = 1.0 / base**exponents
    interpolated = extrapolated / factor
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(
        0, 1
    )
    keep_extrapolated = 1.0 - ramp
    inv_freq = interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Rotates the last dim of q/k slices by position.

    `interleaved` pairs (x[2i], x[2i+1]) (GPT-J); otherwise (x[i], x[i + d/2]) (NeoX).
    `attention_scale` is the softmax-scale multiplier the scaling implies (mscale^2).
    """

    def __init__(
        self,
        rotary_dim: int,
        base: float = 10000.0,
        scaling: dict | None = None,
        interleaved: bool = True,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        cos_sin_scale, self.attention_scale = 1.0, 1.0
        if kind == "yarn":
            factor = float(scaling["factor"])
            inv_freq = _yarn_inv_freq(rotary_dim, base, scaling)
            mscale = float(scaling.get("mscale", 1.0))
            mscale_all = float(scaling.get("mscale_all_dim", 0.0))
            cos_sin_scale = yarn_mscale(factor, mscale) / yarn_mscale(
                factor, mscale_all
            )
            if mscale_all:
                self.attention_scale = yarn_mscale(factor, mscale_all) ** 2
        elif kind == "default":
            inv_freq = 1.0 / base ** (
                torch.arange(0, rotary_dim, 2).float() / rotary_dim
            )
        else:
            raise ValueError(
                f"unsupported rope scaling type {kind!r}; allowed: default, yarn"
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.cos_sin_scale = cos_sin_scale

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, rotary_dim] (or [N, rotary_dim]); positions: [N]."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq.to(x.device)
        cos = (angles.cos() * self.cos_sin_scale).unsqueeze(-2)
        sin = (angles.sin() * self.cos_sin_scale).unsqueeze(-2)
        squeeze = x.dim() == 2
        xf = x.float().unsqueeze(-2) if squeeze else x.float()
        if self.interleaved:
            a, b = xf[..., 0::2], xf[..., 1::2]
        else:
            a, b = xf.chunk(2, dim=-1)
        ra, rb = a * cos - b * sin, b * cos + a * sin
        if self.interleaved:
            out = torch.stack((ra, rb), dim=-1).flatten(-2)
        else:
            out = torch.cat((ra, rb), dim=-1)
        out = out.squeeze(-2) if squeeze else out
        return out.to(x.dtype)


def norm_and_rotate(
    x: torch.Tensor, norm: RMSNorm, rotary: RotaryEmbedding, positions: torch.Tensor
) -> torch.Tensor:
    """rotary on the first `rotary.rotary_dim` channels of norm(x), the others
    passed through: x [N, heads, head_dim], positions [N]. On CUDA one Triton kernel
    (`kernels/head_norm_rope.py`) for the NeoX pairing."""
    if use_norm_kernel(x) and not rotary.interleaved:
        from atom.kernels.head_norm_rope import head_norm_rope_triton

        return head_norm_rope_triton(
            x,
            norm.weight,
            norm.eps,
            norm.weight_offset,
            positions,
            rotary.inv_freq,
            rotary.cos_sin_scale,
        )
    normed = norm(x)
    if rotary.rotary_dim == x.shape[-1]:
        return rotary(positions, normed)
    rotated, passed = normed.split(
        [rotary.rotary_dim, x.shape[-1] - rotary.rotary_dim], dim=-1
    )
    return torch.cat([rotary(positions, rotated), passed], dim=-1)
