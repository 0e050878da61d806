"""Routed experts shared by every MoE model: the router gate and the fused experts.

Routed experts run as grouped matrix products over tokens sorted by expert
(`grouped_experts.py`). Each TP rank holds its I_e/tp slice of every expert; partial
expert sums must be reduced before anything nonlinear touches them.

Checkpoints store one tensor per expert and projection (`experts.{e}.w1` gate,
`.w3` up, `.w2` down; MXFP4 checkpoints `.weight_packed` + `.weight_scale`);
`expert_checkpoint_target` maps those names onto the fused parameters.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from atom.distributed.parallel_state import get_tp_group
from atom.model_ops.dense_product import dense_linear
from atom.model_ops.grouped_experts import (
    CAPTURABLE_PATHS,
    ExpertChoice,
    ExpertPath,
    expert_path,
    grouped_expert_mlp,
    step_path,
)
from atom.model_ops.linear import check_shape, divide, shard_of
from atom.model_ops.quantization.mxfp4 import dequantize_mxfp4
from atom.model_ops.side_stream import Pending, run_beside

if TYPE_CHECKING:
    from atom.model_ops.quantization.methods import ExpertsMethod

EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
MXFP4_PARTS = ("packed", "scale")

# `experts.{e}.w1` (gate), `.w3` (up), `.w2` (down), with or without `.weight`, or the
# MXFP4 halves `.weight_packed` / `.weight_scale`.
_EXPERT = re.compile(
    r"^(?P<owner>.*\.experts)\.(?P<e>\d+)\.(?P<w>w[123])"
    r"(\.weight(_(?P<part>packed|scale))?)?$"
)


class ExpertPart(NamedTuple):
    """Shard id of one half of an MXFP4 expert projection: (expert, "w1", "packed")."""

    expert: int
    projection: str
    part: str  # "packed" | "scale"

    def __str__(self) -> str:
        # The loader names absent shards with str(): show the checkpoint tensor.
        return f"experts.{self.expert}.{self.projection}.weight_{self.part}"


def expert_checkpoint_target(name: str) -> tuple[str, object] | None:
    """(fused parameter, shard id) of a per-expert checkpoint tensor, or None when
    `name` is not one."""
    expert = _EXPERT.match(name)
    if expert is None:
        return None
    fused = f"{expert['owner']}.{'w2' if expert['w'] == 'w2' else 'w13'}"
    if expert["part"]:
        return fused, ExpertPart(int(expert["e"]), expert["w"], expert["part"])
    return fused, (int(expert["e"]), expert["w"])


class FusedExperts(nn.Module):
    """All routed experts: w13 [E, 2*I_e/tp, D] (gate rows first), w2 [E, D, I_e/tp].

    D is the width the experts read (H, or a latent width). Loaded from per-expert
    checkpoint tensors with shard ids (expert, "w1" | "w3" | "w2"); every pair is
    expected, so a missing expert tensor fails the load. MXFP4 checkpoints send each
    projection as two halves, ExpertPart(expert, name, "packed" | "scale"): the first
    is held until its partner arrives, then the full weight is dequantized and only
    then TP-sliced (a slice of packed bytes would cut through scale blocks).
    """

    def __init__(
        self, num_experts: int, intermediate_size: int, width: int, act: nn.Module
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_experts = num_experts
        inner = divide(intermediate_size, self.tp_size, "moe_intermediate")
        self.local_inner = inner
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * inner, width), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, width, inner), requires_grad=False
        )
        for param, names in ((self.w13, ("w1", "w3")), (self.w2, ("w2",))):
            param.weight_loader = self.weight_loader
            param.expected_shards = {
                (e, name) for e in range(num_experts) for name in names
            }
        # (expert, name) -> the half of an MXFP4 pair that arrived first.
        self._pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        # (expert, name) -> whether the checkpoint sent it as MXFP4.
        self._loaded_mxfp4: dict[tuple[int, str], bool] = {}
        self.act = act
        # Decided on first use, once the weights sit on their device.
        self._path: ExpertPath | None = None
        # Whether the checkpoint's config declares these experts MXFP4.
        self.expects_mxfp4 = False
        # None: the stacks stay in the model dtype (`quantization/apply.py`).
        self.quant_method: ExpertsMethod | None = None

    def expect_mxfp4(self) -> None:
        """The config declares MXFP4 experts: account for packed + scale halves."""
        self.expects_mxfp4 = True
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
        self,
        x: torch.Tensor,
        choice: ExpertChoice,
        addend: torch.Tensor | Pending | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """This rank's partial sum_k w_k * expert_k(x) (+ addend) over the router's
        `choice`, [N, D] in `out_dtype`, summed in fp32 (`grouped_expert_mlp`)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, choice, addend, out_dtype)
        path = step_path(self.path, choice.ids.numel(), x.device)
        return grouped_expert_mlp(
            x,
            choice,
            self.w13,
            self.w2,
            self.act,
            path,
            addend=addend,
            out_dtype=out_dtype,
        )

    @property
    def path(self) -> ExpertPath:
        """How the grouped products run (`grouped_experts.expert_path`)."""
        if self._path is None:
            self._path = expert_path(self.w13, self.w2)
        return self._path

    @property
    def graph_capturable(self) -> bool:
        """True when the experts run with no host sync (one kernel per projection)."""
        if self.quant_method is not None:
            return self.quant_method.graph_capturable
        return self.path in CAPTURABLE_PATHS


# A MoE block's router: the experts of each token of x [N, H].
ExpertChooser = Callable[[torch.Tensor], ExpertChoice]


def expert_block_output(
    experts: FusedExperts,
    x: torch.Tensor,
    choose: ExpertChooser,
    shared: nn.Module | None,
) -> torch.Tensor:
    """A MoE block's output in x's dtype: the routed experts' weighted sum for the
    experts `choose(x)` picks, plus the shared experts' output, reduced over the TP
    ranks once.

    `shared` must leave its product unreduced (`GatedMLP(reduce_results=False)`):
    its partial output joins the routed partial sum in fp32 inside the combine, so
    one all-reduce serves both. At one rank the combine writes the block's output
    itself, with no add or cast after it. On a GPU the shared experts run on a
    side stream (`side_stream.py`), forked before the router: their products read
    the weights under the router's product, the top-k choice, the sort by expert
    and the routed products, all latency-bound at a small batch."""
    addend = run_beside(lambda: shared(x), x.device) if shared is not None else None
    choice = choose(x)
    tp = get_tp_group()
    if tp.world_size == 1:
        return experts(x, choice, addend, x.dtype)
    return tp.all_reduce(experts(x, choice, addend)).to(x.dtype)


class RouterGate(nn.Module):
    """The replicated router: `weight` [E, H] and `e_score_correction_bias` [E].

    Logits are computed in fp32, so the weight is stored in fp32 (a bf16 checkpoint
    value upcasts exactly at load) rather than cast on every forward. `bias_dtype`
    fixes the bias's dtype (fp32 for checkpoints that ship an fp32 router); None
    keeps the model's dtype.
    """

    def __init__(
        self, hidden: int, num_experts: int, bias_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=bias_dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, out_dtype=torch.float32)
