"""Gated FFN activations: SiLU (SwiGLU), SiTU and the clamped SwiGLU-OAI.

Both take the packed `[..., 2I]` projection, gate half first, and return `[..., I]`.
"""

import torch
import torch.nn.functional as F
from torch import nn

silu = F.silu

_ALLOWED_ACTS = ("silu", "swiglu", "situ")


def _split_gate_up(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must hold [gate | up], got odd size {x.shape[-1]}")
    return x.chunk(2, dim=-1)


class SiluAndMul(nn.Module):
    """silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _split_gate_up(x)
        return F.silu(gate) * up


class SiTUAndMul(nn.Module):
    """act(gate) * up' with act(g) = beta*tanh(g/beta)*sigmoid(g) and, when
    linear_beta is set, up' = linear_beta*tanh(u/linear_beta); fp32 compute."""

    def __init__(self, beta: float = 4.0, linear_beta: float | None = None) -> None:
        super().__init__()
        if not beta > 0 or (linear_beta is not None and not linear_beta > 0):
            raise ValueError(
                f"SiTU betas must be positive, got beta={beta}, "
                f"linear_beta={linear_beta}"
            )
        self.beta = float(beta)
        self.linear_beta = None if linear_beta is None else float(linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (half.float() for half in _split_gate_up(x))
        act = self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate)
        if self.linear_beta is not None:
            up = self.linear_beta * torch.tanh(up / self.linear_beta)
        return (act * up).to(x.dtype)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, linear_beta={self.linear_beta}"


class SwigluOAIAndMul(nn.Module):
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

    The gate has no lower clamp; the "+1" on the up half is part of the activation.
    """

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        if not alpha > 0 or not limit > 0:
            raise ValueError(
                f"swiglu alpha and limit must be positive, got alpha={alpha}, "
                f"limit={limit}"
            )
        self.alpha = float(alpha)
        self.limit = float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _split_gate_up(x)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1.0) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


def get_act_and_mul(
    hidden_act: str,
    situ_beta: float | None = None,
    situ_linear_beta: float | None = None,
) -> nn.Module:
    """The gated activation named by config `hidden_act` (SiTU beta defaults to 1.0)."""
    name = hidden_act.lower()
    if name in ("silu", "swiglu"):
        return SiluAndMul()
    if name == "situ":
        return SiTUAndMul(1.0 if situ_beta is None else situ_beta, situ_linear_beta)
    raise ValueError(
        f"unsupported hidden_act {hidden_act!r}; allowed: {', '.join(_ALLOWED_ACTS)}"
    )
