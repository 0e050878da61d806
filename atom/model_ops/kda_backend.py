"""Where KDA recurrences run: pure torch everywhere, fla's Triton kernels on CUDA.

Every backend has the contract of `atom.model_ops.kda`: one sequence, q and k already
L2-normalised, g the fp32 log-decay, beta fp32, state value-first [h, Dv, Dk] fp32 (or
None for zeros); outputs are fp32. `ATOM_KDA_BACKEND=auto|torch|fla` overrides the
choice (auto: fla when on CUDA and importable, else torch).
"""

import importlib
import os
from typing import Protocol

import torch

from atom.model_ops.kda import chunk_kda, recurrent_kda

BACKEND_ENV_VAR = "ATOM_KDA_BACKEND"
_CHOICES = ("auto", "torch", "fla")


class KDABackend(Protocol):
    name: str

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Many tokens of one sequence: (o [T, h, Dv], final state [h, Dv, Dk])."""
        ...

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
        return_all_states: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Few tokens (decode / speculative verify); with return_all_states also the
        state after every row [T, h, Dv, Dk]."""
        ...


class TorchKDABackend:
    name = "torch"

    def prefill(self, q, k, v, g, beta, state):
        return chunk_kda(q, k, v, g, beta, state)

    def decode(self, q, k, v, g, beta, state, return_all_states=False):
        return recurrent_kda(
            q, k, v, g, beta, state, return_all_states=return_all_states
        )


class FlaKDABackend:
    """Wraps fla's chunk / fused-recurrent KDA kernels.

    fla takes batched `[B, T, h, D]` inputs and a key-first state `[N, h, Dk, Dv]`, so
    one sequence is a batch of one and the state is transposed on the way in and out.
    fla exposes no per-row states, so decode with return_all_states uses torch.
    """

    name = "fla"

    def __init__(self) -> None:
        kda_ops = importlib.import_module("fla.ops.kda")
        self._chunk = kda_ops.chunk_kda
        self._recurrent = kda_ops.fused_recurrent_kda

    def _run(self, kernel, q, k, v, g, beta, state):
        key_first = None
        if state is not None:
            key_first = state.float().transpose(1, 2).contiguous().unsqueeze(0)
        o, final = kernel(
            q=q.float().unsqueeze(0).contiguous(),
            k=k.float().unsqueeze(0).contiguous(),
            v=v.float().unsqueeze(0).contiguous(),
            g=g.float().unsqueeze(0).contiguous(),
            beta=beta.float().unsqueeze(0).contiguous(),
            scale=k.shape[-1] ** -0.5,
            initial_state=key_first,
            output_final_state=True,
        )
        return o[0].float(), final[0].float().transpose(1, 2).contiguous()

    def prefill(self, q, k, v, g, beta, state):
        return self._run(self._chunk, q, k, v, g, beta, state)

    def decode(self, q, k, v, g, beta, state, return_all_states=False):
        if return_all_states:
            return recurrent_kda(q, k, v, g, beta, state, return_all_states=True)
        return self._run(self._recurrent, q, k, v, g, beta, state)


def fla_available() -> bool:
    try:
        importlib.import_module("fla.ops.kda")
    except ImportError:
        return False
    return True


def select_kda_backend(
    device: torch.device | str, choice: str | None = None
) -> KDABackend:
    """The KDA backend for `device`; `choice` (else $ATOM_KDA_BACKEND, else auto)."""
    choice = (choice or os.environ.get(BACKEND_ENV_VAR) or "auto").lower()
    if choice not in _CHOICES:
        raise ValueError(
            f"{BACKEND_ENV_VAR}={choice!r}; allowed: {', '.join(_CHOICES)}"
        )
    on_cuda = torch.device(device).type == "cuda"
    if choice == "torch":
        return TorchKDABackend()
    if choice == "fla":
        if not on_cuda:
            raise ValueError(f"the fla KDA backend needs a CUDA device, got {device}")
        if not fla_available():
            raise ValueError(
                "the fla KDA backend was requested but fla (flash-linear-attention) "
                "is not importable"
            )
        return FlaKDABackend()
    if on_cuda and fla_available():
        return FlaKDABackend()
    return TorchKDABackend()
