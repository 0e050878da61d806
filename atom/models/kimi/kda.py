"""Kimi Delta Attention layer with per-sequence conv / recurrent state slots.

Heads are split across TP ranks: every per-channel or per-head tensor (projections,
convs, dt_bias, A_log, b_proj) keeps this rank's heads; o_proj reduces.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from atom.distributed.parallel_state import get_tp_group
from atom.model_ops.dense_product import dense_linear
from atom.model_ops.kda import kda_output_norm_gate
from atom.model_ops.kda_backend import (
    KDABackend,
    KDAGates,
    StateSlots,
    pointwise_kernels,
    prepare,
    select_kda_backend,
)
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    check_shape,
    shard_of,
)
from atom.model_ops.side_stream import Pending, run_beside
from atom.models.interfaces import StateTensor
from atom.models.kimi.config import KimiTextConfig
from atom.utils.forward_context import require_metadata

# Checkpoint projection -> shard of a KDA layer's merged `in_proj`: this rank's
# [q_r; k_r; v_r] (the conv's channel order), then the replicated low-rank halves
# of the forget gate and, where the output gate is low-rank, of that gate.
KDA_IN_PROJ_SHARDS = (
    ("q_proj", 0),
    ("k_proj", 1),
    ("v_proj", 2),
    ("f_a_proj", 3),
    ("g_a_proj", 4),
)


def fp32_channel_sharded(*shape: int) -> nn.Parameter:
    """An fp32 parameter whose dim 0 is this rank's slice of the checkpoint's."""
    tp = get_tp_group()
    param = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        piece = shard_of(loaded, 0, tp.rank_in_group, tp.world_size)
        check_shape(param, piece)
        param.data.copy_(piece)

    param.weight_loader = load
    return param


class ConvWeight(nn.Module):
    """Holds one depthwise conv weight [C/tp, 1, K] (checkpoint `*_conv1d.weight`)."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = fp32_channel_sharded(channels, 1, kernel_size)


class KimiDeltaAttention(nn.Module):
    def __init__(
        self, config: KimiTextConfig, prefix: str = "", backend: str = "auto"
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.prefix = prefix
        hidden, dim = config.hidden_size, config.kda_head_dim
        self.total_heads = config.kda_heads
        self.heads = config.kda_heads // self.tp_size
        self.head_dim = dim
        self.kernel_size = config.conv_kernel_size
        self.lower_bound = config.gate_lower_bound
        self.eps = config.rms_norm_eps
        width = config.kda_heads * dim
        self.local_width = width // self.tp_size

        # q_proj, k_proj, v_proj, f_a_proj (and g_a_proj) of the checkpoint read
        # the same x: one product (KDA_IN_PROJ_SHARDS). The low-rank halves are
        # small (D x H) and latency-bound alone: two launches a layer fewer.
        low_rank_gate = not config.use_full_rank_gate
        sizes = [width] * 3 + [dim] * (2 if low_rank_gate else 1)
        self.in_proj = MergedColumnParallelLinear(
            hidden, sizes, replicated=frozenset(range(3, len(sizes)))
        )
        self.q_conv1d = ConvWeight(self.local_width, self.kernel_size)
        self.k_conv1d = ConvWeight(self.local_width, self.kernel_size)
        self.v_conv1d = ConvWeight(self.local_width, self.kernel_size)
        self.f_b_proj = ColumnParallelLinear(dim, width)
        self.b_proj = ColumnParallelLinear(hidden, config.kda_heads)
        if low_rank_gate:
            self.g_b_proj = ColumnParallelLinear(dim, width)
        else:
            self.g_proj = ColumnParallelLinear(hidden, width)
        self.A_log = nn.Parameter(
            torch.empty(self.heads, dtype=torch.float32), requires_grad=False
        )
        self.A_log.weight_loader = self._load_a_log
        self.dt_bias = fp32_channel_sharded(self.local_width)
        self.o_norm = RMSNorm(dim, eps=self.eps).float()
        self.o_proj = RowParallelLinear(width, hidden)
        # `Config.kda_backend`; resolved on the first forward, which knows the device.
        self.backend_choice = backend
        self._backend: KDABackend | None = None
        # A `RecurrentStateLayer` (models/interfaces.py); see `bind_states`.
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.conv_snapshots: torch.Tensor | None = None
        self.ssm_snapshots: torch.Tensor | None = None
        # (source data pointers, derived tensors) of `_derived_weights`.
        self._derived: tuple[tuple[int, ...], tuple[torch.Tensor, ...]] | None = None

    def state_spec(self) -> tuple[StateTensor, ...]:
        """Per slot: the conv inputs [3P/tp, K-1] in the model dtype and the
        recurrent state [h/tp, Dv, Dk] in fp32 (the recurrence accumulates there)."""
        return (
            StateTensor("conv", (3 * self.local_width, self.kernel_size - 1)),
            StateTensor(
                "ssm", (self.heads, self.head_dim, self.head_dim), torch.float32
            ),
        )

    def bind_states(
        self,
        states: dict[str, torch.Tensor],
        snapshots: dict[str, torch.Tensor] | None,
    ) -> None:
        self.conv_state, self.ssm_state = states["conv"], states["ssm"]
        # Rebinding replaces everything, so no buffer of an older engine lingers.
        self.conv_snapshots = snapshots["conv"] if snapshots else None
        self.ssm_snapshots = snapshots["ssm"] if snapshots else None

    def _load_a_log(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        # Checkpoints store [n] or legacy [1, 1, n, 1], with n >= heads (K3: 128 for
        # 96); the first `heads` entries are the real ones.
        legacy = (
            loaded.dim() == 4 and loaded.shape[:2] == (1, 1) and loaded.shape[3] == 1
        )
        if loaded.dim() != 1 and not legacy:
            raise ValueError(
                f"A_log must be [n] or [1, 1, n, 1], got {tuple(loaded.shape)}"
            )
        flat = loaded.reshape(-1)
        if flat.numel() < self.total_heads:
            raise ValueError(
                f"A_log holds {flat.numel()} entries for {self.total_heads} KDA heads"
            )
        mine = flat[: self.total_heads].narrow(0, self.tp_rank * self.heads, self.heads)
        param.data.copy_(mine)

    def _conv_weight(self) -> torch.Tensor:
        return self._derived_weights()[0]

    def _derived_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the q, k, v conv weights as one [3W/tp, K], b_proj's weight in fp32),
        made once from the loaded parameters instead of by a copy and a cast in
        every forward; made again if the parameters were replaced or moved."""
        sources = (
            self.q_conv1d.weight,
            self.k_conv1d.weight,
            self.v_conv1d.weight,
            self.b_proj.weight,
        )
        key = tuple(p.data_ptr() for p in sources)
        if self._derived is None or self._derived[0] != key:
            conv = torch.cat(sources[:3], dim=0)[:, 0, :]
            self._derived = (key, (conv, self.b_proj.weight.float()))
        return self._derived[1]

    def _require_cache(self) -> None:
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError(
                f"KDA layer {self.prefix!r} has no state cache; bind one with CacheEngine"
            )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        metadata = require_metadata(f"KDA layer {self.prefix!r}")
        self._require_cache()
        if self._backend is None:
            self._backend = select_kda_backend(x.device, self.backend_choice)
        # The gates' small products run on a side stream (`side_stream.py`): the
        # write strength's under in_proj's product, the forget and output gates'
        # (which read in_proj's low-rank columns) under the conv and the recurrence.
        # The write strength is formed in fp32: bf16 here measurably costs accuracy.
        b_weight = self._derived_weights()[1]
        b_logits = run_beside(
            lambda: dense_linear(x, b_weight, out_dtype=torch.float32), x.device
        )
        projected = self.in_proj(x)
        # q, k and v side by side (a view: the conv reads strided rows).
        mixed = projected[..., : 3 * self.local_width]
        f_low, *g_low = self.in_proj.split(projected)[3:]
        forget = run_beside(lambda: self.f_b_proj(f_low), x.device)
        output_gate = run_beside(
            lambda: self.g_b_proj(g_low[0]) if g_low else self.g_proj(x), x.device
        )
        o = metadata.unpad(self._recur(metadata.pad(mixed), forget, b_logits))
        gate = output_gate.wait()
        if pointwise_kernels(x):
            from atom.kernels.kda_head_norms import output_norm_gate

            y = output_norm_gate(o, self.o_norm.weight, gate, self.eps, x.dtype)
        else:
            y = kda_output_norm_gate(o, self.o_norm.weight, gate, self.eps)
        return self.o_proj(y.to(x.dtype))

    def _recur(
        self, mixed: torch.Tensor, forget: Pending, b_logits: Pending
    ) -> torch.Tensor:
        """Conv + recurrence of all sequences at once, rows padded [B, T, ...]
        (the gate inputs flat, as the projections made them, joined once the conv
        is queued).

        Reads each sequence's states from its slot (zeros for a fresh sequence),
        writes the states after its last row back, and on a verify step also the
        state after every row, for commit(num_rows) to choose from.
        """
        metadata = require_metadata(f"KDA layer {self.prefix!r}")
        slots, context_lens = metadata.state_slots, metadata.context_lens
        batch, rows = mixed.shape[:2]
        ssm = StateSlots(self.ssm_state, slots, context_lens)
        conv = StateSlots(self.conv_state, slots, context_lens)
        # Decode, verify and prefills the backend finds small enough run row by row
        # in the state pools; larger prefills run its chunked prefill.
        decode = metadata.keeps_row_states or self._backend.runs_as_decode(batch, rows)
        if metadata.keeps_row_states:
            self._check_snapshot_rows(rows)
            ssm = dataclasses.replace(ssm, snapshots=self.ssm_snapshots)
            conv = dataclasses.replace(conv, snapshots=self.conv_snapshots)
        conved = self._backend.conv(mixed, self._conv_weight(), conv, metadata)
        gates = KDAGates(
            forget.wait(), b_logits.wait(), self.A_log, self.dt_bias, self.lower_bound
        )
        if decode:  # q, k's norms and the gates may run inside the decode kernel
            return self._backend.decode_raw(conved, gates, ssm, metadata)
        q, k, v, g, beta = prepare(conved, gates, metadata)
        o, final = self._backend.prefill(q, k, v, g, beta, ssm.gather(), metadata)
        ssm.scatter(final, None)
        return o

    def _check_snapshot_rows(self, rows: int) -> None:
        if self.ssm_snapshots is None or self.conv_snapshots is None:
            raise RuntimeError(
                f"KDA layer {self.prefix!r} verifies drafts but no snapshot "
                "buffers are bound (CacheEngine num_verify_rows=0)"
            )
        if rows > self.ssm_snapshots.shape[1]:
            raise RuntimeError(
                f"{rows} verify rows exceed the {self.ssm_snapshots.shape[1]} "
                "snapshot rows bound"
            )
