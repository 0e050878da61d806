"""Where KDA recurrences run: pure torch everywhere, fla's Triton kernels on CUDA.

Every backend has the contract of `atom.model_ops.kda`: a batch of sequences padded to
[B, T, h, D], q and k already L2-normalised, g the fp32 log-decay, beta fp32, start
states value-first [B, h, Dv, Dk] fp32; outputs are fp32. `Config.kda_backend`
(`ATOM_KDA_BACKEND=auto|torch|fla`) picks one (auto: fla when on CUDA and importable,
else torch).
"""

import importlib
from typing import Protocol

import torch

from atom.config import KDA_BACKENDS
from atom.model_ops.kda import chunk_kda, recurrent_kda
from atom.utils.forward_context import AttentionMetadata


class KDABackend(Protocol):
    name: str

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Many rows per sequence, padded [B, T, ...]: (o [B, T, h, Dv], final
        [B, h, Dv, Dk]). `metadata` gives the real rows of each sequence."""
        ...

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        return_all_states: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Few rows per sequence (decode / speculative verify), padded [B, T, ...];
        with return_all_states also the state after every row [B, T, h, Dv, Dk]."""
        ...


class TorchKDABackend:
    """Plain PyTorch: padded rows (g = 0, beta = 0) are neutral, so no lengths needed."""

    name = "torch"

    def prefill(self, q, k, v, g, beta, state, metadata):
        return chunk_kda(q, k, v, g, beta, state)

    def decode(self, q, k, v, g, beta, state, return_all_states=False):
        return recurrent_kda(
            q, k, v, g, beta, state, return_all_states=return_all_states
        )


class FlaKDABackend:
    """Wraps fla's varlen chunk and fused-recurrent KDA kernels.

    fla keeps states key-first `[N, h, Dk, Dv]`, so states are transposed on the way
    in and out. Prefill runs the real rows only, as one varlen batch over the step's
    `query_start_loc`. fla exposes no per-row states, so decode with
    return_all_states uses torch.
    """

    name = "fla"

    def __init__(self) -> None:
        kda_ops = importlib.import_module("fla.ops.kda")
        self._chunk = kda_ops.chunk_kda
        self._recurrent = kda_ops.fused_recurrent_kda

    def _run(self, kernel, q, k, v, g, beta, state, cu_seqlens=None):
        o, final = kernel(
            q=q.float().contiguous(),
            k=k.float().contiguous(),
            v=v.float().contiguous(),
            g=g.float().contiguous(),
            beta=beta.float().contiguous(),
            scale=k.shape[-1] ** -0.5,
            initial_state=state.float().transpose(2, 3).contiguous(),
            output_final_state=True,
            cu_seqlens=cu_seqlens,
        )
        return o.float(), final.float().transpose(2, 3).contiguous()

    def prefill(self, q, k, v, g, beta, state, metadata):
        flat = [metadata.unpad(t).unsqueeze(0) for t in (q, k, v, g, beta)]
        o, final = self._run(
            self._chunk, *flat, state, cu_seqlens=metadata.query_start_loc
        )
        return metadata.pad(o[0]), final

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


def select_kda_backend(device: torch.device | str, choice: str = "auto") -> KDABackend:
    """The KDA backend `choice` (`Config.kda_backend`) names for `device`."""
    if choice not in KDA_BACKENDS:
        raise ValueError(
            f"unknown KDA backend {choice!r}; allowed: {', '.join(KDA_BACKENDS)}"
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
