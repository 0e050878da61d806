"""Gated FFN activations: SiLU (SwiGLU), SiTU and the clamped SwiGLU-OAI.

Each takes the packed `[..., 2I]` projection, gate half first, and returns `[..., I]`.
On CUDA one Triton kernel computes any of them (`kernels/gated_act.py`); each
module's `reference` is the torch definition the kernel is tested against.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels import triton_available

silu = F.silu

_ALLOWED_ACTS = ("silu", "swiglu", "situ")


def _split_gate_up(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must hold [gate | up], got odd size {x.shape[-1]}")
    return x.chunk(2, dim=-1)


class GatedAct(NamedTuple):
    """A gated activation as the Triton kernels take it: its name in
    `kernels/gated_act.py`'s ACTIVATIONS and its two parameters."""

    name: str
    p0: float
    p1: float | None


class GatedActivation(nn.Module):
    """act(gate) * up: the Triton kernel on CUDA, `reference` elsewhere."""

    def kernel_args(self) -> GatedAct:
        """(activation name, p0, p1) as `kernels.gated_act.gated_act_triton` and the
        grouped expert GEMM's fused epilogue (`kernels/expert_gemm.py`) take it."""
        raise NotImplementedError

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and triton_available(x.device):
            from atom.kernels.gated_act import gated_act_triton

            _split_gate_up(x)  # the same error as the reference for an odd width
            return gated_act_triton(x, *self.kernel_args())
        return self.reference(x)


class SiluAndMul(GatedActivation):
    """silu(gate) * up."""

    def kernel_args(self) -> GatedAct:
        return GatedAct("silu", 0.0, None)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _split_gate_up(x)
        return F.silu(gate) * up


class SiTUAndMul(GatedActivation):
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

    def kernel_args(self) -> GatedAct:
        return GatedAct("situ", self.beta, self.linear_beta)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (half.float() for half in _split_gate_up(x))
        act = self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate)
        if self.linear_beta is not None:
            up = self.linear_beta * torch.tanh(up / self.linear_beta)
        return (act * up).to(x.dtype)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, linear_beta={self.linear_beta}"


class SwigluOAIAndMul(GatedActivation):
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

    def kernel_args(self) -> GatedAct:
        return GatedAct("swiglu_oai", self.alpha, self.limit)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
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
