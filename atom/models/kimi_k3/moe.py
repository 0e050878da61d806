"""Feed-forward blocks: dense gated MLP, routed experts, plain and latent MoE.

Routed experts run as grouped matrix products over tokens sorted by expert
(`model_ops/grouped_experts.py`). Each rank holds its I_e/tp slice of every expert; partial expert sums are
reduced before anything nonlinear touches them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.distributed.parallel_state import get_tp_group
from atom.model_ops.activation import get_act_and_mul
from atom.model_ops.grouped_experts import experts_use_grouped_mm, grouped_expert_mlp
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    check_shape,
    divide,
    shard_of,
)
from atom.model_ops.moe_router import select_experts
from atom.model_ops.mxfp4 import dequantize_mxfp4
from atom.models.kimi_k3.config import KimiTextConfig
from atom.models.kimi_k3.names import ExpertPart

EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
MXFP4_PARTS = ("packed", "scale")


def make_act(config: KimiTextConfig) -> nn.Module:
    return get_act_and_mul(config.hidden_act, config.situ_beta, config.situ_linear_beta)


class GatedMLP(nn.Module):
    """down(act(gate x) * up x); gate/up packed into `gate_up_proj` (shards 0, 1)."""

    def __init__(self, config: KimiTextConfig, inner: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inner, inner])
        self.act = make_act(config)
        self.down_proj = RowParallelLinear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class FusedExperts(nn.Module):
    """All routed experts: w13 [E, 2*I_e/tp, D] (gate rows first), w2 [E, D, I_e/tp].

    D is the latent width R for a latent MoE, else H. Loaded from per-expert
    checkpoint tensors with shard ids (expert, "w1" | "w3" | "w2"); every pair is
    expected, so a missing expert tensor fails the load. MXFP4 checkpoints send each
    projection as two halves, ExpertPart(expert, name, "packed" | "scale"): the first
    is held until its partner arrives, then the full weight is dequantized and only
    then TP-sliced (a slice of packed bytes would cut through scale blocks).
    """

    def __init__(self, config: KimiTextConfig, width: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_experts = config.num_experts
        inner = divide(config.moe_intermediate_size, self.tp_size, "moe_intermediate")
        self.local_inner = inner
        self.w13 = nn.Parameter(
            torch.empty(self.num_experts, 2 * inner, width), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(self.num_experts, width, inner), requires_grad=False
        )
        for param, names in ((self.w13, ("w1", "w3")), (self.w2, ("w2",))):
            param.weight_loader = self.weight_loader
            param.expected_shards = {
                (e, name) for e in range(self.num_experts) for name in names
            }
        # (expert, name) -> the half of an MXFP4 pair that arrived first.
        self._pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        # (expert, name) -> whether the checkpoint sent it as MXFP4.
        self._loaded_mxfp4: dict[tuple[int, str], bool] = {}
        self.act = make_act(config)
        # Decided on first use, once the weights sit on their device.
        self._grouped_mm: bool | None = None

    def expect_mxfp4(self) -> None:
        """The config declares MXFP4 experts: account for packed + scale halves."""
        for e in range(self.num_experts):
            for name in EXPERT_PROJECTIONS:
                self._expect(e, name, mxfp4=True)

    def _expect(self, expert: int, name: str, mxfp4: bool) -> None:
        expected = (self.w2 if name == "w2" else self.w13).expected_shards
        halves = {ExpertPart(expert, name, part) for part in MXFP4_PARTS}
        if mxfp4:
            expected.discard((expert, name))
            expected |= halves
        else:
            expected -= halves
            expected.add((expert, name))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple
    ) -> None:
        expert, name, *part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside [0, {self.num_experts})")
        mxfp4 = bool(part)
        form = self._loaded_mxfp4.setdefault((expert, name), mxfp4)
        if form != mxfp4:
            raise ValueError(
                f"expert {expert} {name} comes both as a plain weight and as MXFP4"
            )
        # Follow the checkpoint's form even if the config did not declare it, so
        # accounting then asks for exactly the halves this projection still lacks.
        self._expect(expert, name, mxfp4)
        if mxfp4:
            loaded = self._complete_pair(expert, name, part[0], loaded, param.dtype)
            if loaded is None:
                return
        if name == "w2":
            target = param.data[expert]
            piece = shard_of(loaded, 1, self.tp_rank, self.tp_size)
        else:
            offset = 0 if name == "w1" else self.local_inner
            target = param.data[expert].narrow(0, offset, self.local_inner)
            piece = shard_of(loaded, 0, self.tp_rank, self.tp_size)
        check_shape(target, piece, f"expert {expert} {name}")
        target.copy_(piece)

    def _complete_pair(
        self,
        expert: int,
        name: str,
        part: str,
        loaded: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """The dequantized [out, in] weight once both halves arrived, else None."""
        if part not in MXFP4_PARTS:
            raise ValueError(f"unknown MXFP4 part {part!r}; expected {MXFP4_PARTS}")
        halves = self._pending.setdefault((expert, name), {})
        if part in halves:
            raise ValueError(f"expert {expert} {name} weight_{part} arrived twice")
        halves[part] = loaded
        if len(halves) < len(MXFP4_PARTS):
            return None
        del self._pending[(expert, name)]
        try:
            return dequantize_mxfp4(halves["packed"], halves["scale"], dtype)
        except TypeError as err:
            # The loader names the checkpoint tensor for ValueErrors only.
            raise ValueError(str(err)) from err

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sum_k w_k * expert_k(x), [N, D] in fp32."""
        return grouped_expert_mlp(
            x, weights, expert_ids, self.w13, self.w2, self.act, self.graph_capturable
        )

    @property
    def graph_capturable(self) -> bool:
        """True when the experts run with no host sync (one grouped kernel)."""
        if self._grouped_mm is None:
            self._grouped_mm = experts_use_grouped_mm(self.w13, self.w2)
        return self._grouped_mm


class RouterGate(nn.Module):
    """The replicated router: `weight` [E, H] and `e_score_correction_bias` [E]."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Router logits in fp32 (spec 4.5 step 1).
        return F.linear(x.float(), self.weight.float())


class KimiMoE(nn.Module):
    """Routed experts (optionally in a latent space) plus shared experts."""

    def __init__(self, config: KimiTextConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_token
        self.num_expert_group = config.num_expert_group
        self.topk_group = config.topk_group
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.scoring = config.scoring
        self.gate = RouterGate(hidden, config.num_experts)
        latent = config.routed_expert_hidden_size
        self.latent = latent is not None
        if self.latent:
            self.routed_expert_down_proj = ReplicatedLinear(hidden, latent)
            self.routed_expert_up_proj = ReplicatedLinear(latent, hidden)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, eps=config.rms_norm_eps)
        self.experts = FusedExperts(config, latent or hidden)
        self.shared_experts = (
            GatedMLP(config, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = select_experts(
            self.gate(x),
            self.gate.e_score_correction_bias,
            self.top_k,
            self.num_expert_group,
            self.topk_group,
            self.renormalize,
            self.scaling,
            self.scoring,
        )
        tp = get_tp_group()
        if self.latent:
            routed_in = self.routed_expert_down_proj(x)
            # Reduce before the norm: RMSNorm of a partial sum is not a partial norm.
            routed = tp.all_reduce(self.experts(routed_in, weights, expert_ids))
            routed = routed.to(x.dtype)
            if hasattr(self, "routed_expert_norm"):
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
        else:
            routed = tp.all_reduce(self.experts(x, weights, expert_ids)).to(x.dtype)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed
