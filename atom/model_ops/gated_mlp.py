"""The gated feed-forward block every model here uses: down(act(gate x, up x)).

Gate and up are packed into one column-parallel `gate_up_proj` (checkpoint shards 0
and 1), down is row-parallel and reduces unless `reduce_results` is False (a shared
expert whose partial output joins the routed experts' partial sum, reduced once);
`act` maps [..., 2I] to [..., I].
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.linear import MergedColumnParallelLinear, RowParallelLinear

# Checkpoint projection -> (packed parameter, shard id), for models' name maps.
GATE_UP_SHARDS = (("gate_proj", 0), ("up_proj", 1))


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: nn.Module,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size]
        )
        self.act = act
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, reduce_results=reduce_results
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
