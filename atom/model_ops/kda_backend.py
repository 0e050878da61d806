"""Where KDA recurrences run: pure torch everywhere, Triton and fla kernels on CUDA.

Every backend has the contract of `atom.model_ops.kda`: a batch of sequences padded to
[B, T, h, D], q and k already L2-normalised, g the fp32 log-decay, beta fp32, states
value-first [h, Dv, Dk] fp32; outputs are fp32. Prefill takes the start states and
returns the final ones; decode (and verify) works on the layer's state pool in place,
so a kernel can read and write each sequence's slot itself. `decode_raw` takes a
decode step's inputs one stage earlier (q and k before their L2 norms, the gates'
inputs), so a backend may fold those steps into its decode kernel, as the Triton
one does; by default they run apart (`prepare`). `Config.kda_backend`
(`ATOM_KDA_BACKEND=auto|torch|fla|triton`) picks one; auto is triton on CUDA (atom's
decode kernel, fla's chunked prefill when importable), torch elsewhere.
"""

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from atom.config import KDA_BACKENDS
from atom.kernels import require_triton, triton_available
from atom.model_ops.kda import (
    causal_conv1d,
    chunk_kda,
    conv_state_after_each_row,
    kda_forget_gate,
    l2_normalize,
    recurrent_kda,
)
from atom.utils.forward_context import AttentionMetadata


@dataclass(frozen=True)
class StateSlots:
    """A step's states of one kind (recurrent or conv): the layer's pool of them and
    each sequence's slot."""

    pool: torch.Tensor  # [S, ...]: recurrent [S, h, Dv, Dk] fp32, conv [S, C, K-1]
    slots: torch.Tensor  # [B] long
    # [B] tokens cached before this step; a sequence at 0 starts from a zero state
    # (the decode kernels read it as it is, with no mask formed per layer).
    context_lens: torch.Tensor
    # [S, R, ...]: on a verify step, the state after every row is kept here
    # for the commit of the accepted prefix; None on plain decode.
    snapshots: torch.Tensor | None = None

    @property
    def fresh(self) -> torch.Tensor:
        """[B] bool: the sequence starts from a zero state."""
        return self.context_lens == 0

    def gather(self) -> torch.Tensor:
        """[B, ...] start states (zeros for fresh sequences)."""
        start = self.pool.index_select(0, self.slots)
        return torch.where(self.fresh.view(-1, *[1] * (start.dim() - 1)), 0, start)

    def scatter(self, final: torch.Tensor, every_row: torch.Tensor | None) -> None:
        """Store final states [B, ...] (and the per-row ones [B, T, ...] on verify).
        Caches hold values, never autograd history (training runs this path too)."""
        if self.snapshots is not None:
            self.snapshots[self.slots, : every_row.shape[1]] = every_row.detach()
        self.pool.index_copy_(0, self.slots, final.detach())


def pointwise_kernels(x: torch.Tensor) -> bool:
    """Whether a KDA layer's gates and per-head norms run as Triton kernels
    (`kernels/kda_gates.py`, `kernels/kda_head_norms.py`) rather than their torch
    references: on CUDA, where each launch counts."""
    return x.is_cuda and triton_available(x.device)


@dataclass(frozen=True)
class KDAGates:
    """A step's gate inputs, flat rows [N, ...] as the layer's projections made
    them, and the layer's gate parameters (this rank's heads)."""

    f: torch.Tensor  # [N, h * Dk] the forget gate's low-rank projection
    b_logits: torch.Tensor  # [N, h] fp32 logits of the write strength beta
    a_log: torch.Tensor  # [h] fp32
    dt_bias: torch.Tensor  # [h * Dk] fp32
    lower_bound: float | None  # K3's bounded gate; None: Kimi Linear's softplus

    @property
    def heads(self) -> int:
        return self.b_logits.shape[-1]

    @property
    def head_dim(self) -> int:
        return self.dt_bias.numel() // self.heads

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-decay g [N, h, Dk] fp32, beta [N, h] fp32)."""
        if pointwise_kernels(self.f):
            from atom.kernels.kda_gates import kda_gates_triton

            return kda_gates_triton(
                self.f,
                self.a_log,
                self.dt_bias,
                self.lower_bound,
                self.b_logits,
                self.heads,
                self.head_dim,
            )
        f = self.f.reshape(-1, self.heads, self.head_dim)
        g = kda_forget_gate(f, self.a_log, self.dt_bias, self.lower_bound)
        return g, torch.sigmoid(self.b_logits)


def normalized_qkv(
    conved: torch.Tensor, heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) [B, T, h, D] of the conv's output [B, T, 3 * h * D], q and k
    L2-normalised (fp32), v a view."""
    batch, rows = conved.shape[:2]
    width = heads * head_dim
    v = conved[..., 2 * width :].reshape(batch, rows, heads, head_dim)
    if pointwise_kernels(conved):
        from atom.kernels.kda_head_norms import l2_normalize_qk

        q, k = l2_normalize_qk(conved, heads, head_dim)
    else:
        q, k = (
            l2_normalize(part.reshape(batch, rows, heads, head_dim))
            for part in conved[..., : 2 * width].chunk(2, dim=-1)
        )
    return q, k, v


def prepare(
    conved: torch.Tensor, gates: KDAGates, metadata: AttentionMetadata
) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta) padded [B, T, ...] as `prefill` and `decode` take them,
    from the conv's output [B, T, 3 * h * D] and the gate inputs (flat rows: the
    padded rows of g and beta are zeros, which leave a state as it was)."""
    q, k, v = normalized_qkv(conved, gates.heads, gates.head_dim)
    g, beta = gates.values()
    return q, k, v, metadata.pad(g), metadata.pad(beta)


class KDABackend(Protocol):
    name: str

    def runs_as_decode(self, batch: int, rows: int) -> bool:
        """Whether a step of `batch` sequences padded to `rows` rows (not a verify
        step: that always is) runs through `decode`, row by row in the state pools,
        rather than through `prefill`."""
        ...

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
        states: StateSlots,
    ) -> torch.Tensor:
        """Few rows per sequence (decode / speculative verify), padded [B, T, ...]:
        o [B, T, h, Dv]; the pool (and the snapshots on verify) updated in place."""
        ...

    def decode_raw(
        self,
        conved: torch.Tensor,
        gates: KDAGates,
        states: StateSlots,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`decode` from the conv's output conved [B, T, 3 * h * D] (q, k, v side
        by side, q and k not yet normalised) and the gate inputs. Here the separate
        steps then `decode`; a backend may fold them into its decode kernel."""
        return self.decode(*prepare(conved, gates, metadata), states)

    def conv(
        self,
        mixed: torch.Tensor,
        weight: torch.Tensor,
        states: StateSlots,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The short conv + SiLU of a step's rows mixed [B, T, C] (weight [C, K])
        continuing each sequence's conv history, [B, T, C] in mixed.dtype;
        the conv pool (and its snapshots on verify) updated in place."""
        ...


def torch_decode(q, k, v, g, beta, states: StateSlots) -> torch.Tensor:
    """The reference decode: gather, the token loop, scatter."""
    every_row = states.snapshots is not None
    o, final, *rows = recurrent_kda(
        q, k, v, g, beta, states.gather(), return_all_states=every_row
    )
    states.scatter(final, rows[0] if every_row else None)
    return o


def torch_conv(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    states: StateSlots,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """The reference conv of a step's rows: gather, `causal_conv1d`, scatter."""
    history = states.gather()
    lengths = None if metadata.query_len else metadata.query_start_loc.diff()
    conved, final = causal_conv1d(mixed, weight, history, lengths)
    every_row = None
    if states.snapshots is not None:
        every_row = conv_state_after_each_row(mixed, history)
    states.scatter(final, every_row)
    return conved


class TorchKDABackend(KDABackend):
    """Plain PyTorch: padded rows (g = 0, beta = 0) are neutral, so no lengths
    needed."""

    name = "torch"
    conv = staticmethod(torch_conv)

    def runs_as_decode(self, batch, rows):
        return rows == 1

    def prefill(self, q, k, v, g, beta, state, metadata):
        return chunk_kda(q, k, v, g, beta, state)

    def decode(self, q, k, v, g, beta, states):
        return torch_decode(q, k, v, g, beta, states)


class FlaKDABackend(KDABackend):
    """Wraps fla's varlen chunk and fused-recurrent KDA kernels.

    fla keeps states key-first `[N, h, Dk, Dv]`, so states are transposed on the way
    in and out. Prefill runs the real rows only, as one varlen batch over the step's
    `query_start_loc`. fla exposes no per-row states, so decode with
    return_all_states uses torch.
    """

    name = "fla"
    conv = staticmethod(torch_conv)

    def runs_as_decode(self, batch, rows):
        return rows == 1

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

    def decode(self, q, k, v, g, beta, states):
        if states.snapshots is not None:
            return torch_decode(q, k, v, g, beta, states)
        o, final = self._run(self._recurrent, q, k, v, g, beta, states.gather())
        states.scatter(final, None)
        return o


class TritonKDABackend(KDABackend):
    """atom's kernels (`atom/kernels/kda_decode.py`, `kda_conv.py`): each
    sequence's states are read from and written to its slots inside the kernels,
    verify snapshots too. The short conv of every step runs in `kda_conv.py`.
    `decode_raw` runs one kernel: it L2-normalises q and k and forms the gates
    itself, so a decode or verify step launches neither of their kernels.
    The recurrence of a prefill runs `prefill_backend` (fla's chunked kernels when
    importable), but for small prefills: there the two decode kernels, looping over
    the rows, cost one launch each per layer where fla's chunked KDA costs over ten,
    each with its Python-side dispatch, and the GPU's time is the smaller share of
    either.
    Padded rows (g = 0, beta = 0) leave a state as it was, so the decode kernels
    take a padded prefill batch as it is. Their time grows with the rows (one
    after another) and, once the programs outnumber what the GPU runs at once, with
    the batch; fla's stays near its launch floor. The bounds below come from
    `benchmarks/bench_kda_prefill.py` on an H100 at 4 heads of 32: 4.3x faster than
    fla at 8 sequences of 256 rows, and no slower at 8 of 1024."""

    name = "triton"
    # The longest prefill and the most padded rows a step may have to run as decode.
    max_decode_prefill_rows = 256
    max_decode_prefill_tokens = 2048

    def __init__(self, prefill_backend: KDABackend) -> None:
        # Imported here: the kernel modules import triton, which may be absent.
        from atom.kernels.kda_conv import kda_conv_in_pool
        from atom.kernels.kda_decode import kda_decode_in_pool, kda_decode_raw_in_pool

        self.prefill_backend = prefill_backend
        self._decode = kda_decode_in_pool
        self._decode_raw = kda_decode_raw_in_pool
        self._conv = kda_conv_in_pool

    def runs_as_decode(self, batch, rows):
        return rows == 1 or (
            rows <= self.max_decode_prefill_rows
            and batch * rows <= self.max_decode_prefill_tokens
        )

    def conv(self, mixed, weight, states, metadata):
        return self._conv(
            mixed,
            weight,
            states.pool,
            states.slots,
            states.context_lens,
            metadata.query_start_loc,
            states.snapshots,
        )

    def prefill(self, q, k, v, g, beta, state, metadata):
        return self.prefill_backend.prefill(q, k, v, g, beta, state, metadata)

    def decode(self, q, k, v, g, beta, states):
        return self._decode(
            q,
            k,
            v,
            g,
            beta,
            states.pool,
            states.slots,
            states.context_lens,
            states.snapshots,
        )

    def decode_raw(self, conved, gates, states, metadata):
        return self._decode_raw(
            conved,
            gates.f,
            gates.b_logits,
            gates.a_log,
            gates.dt_bias,
            gates.lower_bound,
            metadata.query_start_loc,
            states.pool,
            states.slots,
            states.context_lens,
            states.snapshots,
        )


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
    if choice == "torch" or (choice == "auto" and not on_cuda):
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
    if choice == "triton":
        require_triton(device, "the triton KDA backend")
    if not triton_available(device):
        return FlaKDABackend() if fla_available() else TorchKDABackend()
    prefill = FlaKDABackend() if on_cuda and fla_available() else TorchKDABackend()
    return TritonKDABackend(prefill)
