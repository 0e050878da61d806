"""Linear layers whose weights are split across the tensor-parallel group.

Each parameter carries a `weight_loader(param, checkpoint_tensor[, shard_id])` that
takes the full checkpoint tensor and keeps this rank's slice. Weights load in the
model dtype; a quantization method (`model_ops/quantization/`) set on the layer
before loading converts them afterwards and runs the product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from atom.distributed.parallel_state import get_tp_group
from atom.model_ops.dense_product import dense_linear

if TYPE_CHECKING:
    from atom.model_ops.quantization.methods import LinearMethod


def check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch{' for ' + what if what else ''}: checkpoint tensor "
            f"{tuple(loaded.shape)} vs parameter {tuple(param.shape)}"
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    check_shape(param, loaded)
    param.data.copy_(loaded)


def shard_of(loaded: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of `loaded` along `dim` (must divide evenly)."""
    if loaded.shape[dim] % size:
        raise ValueError(
            f"checkpoint dim {dim} of shape {tuple(loaded.shape)} does not divide "
            f"across {size} tensor-parallel ranks"
        )
    step = loaded.shape[dim] // size
    return loaded.narrow(dim, rank * step, step)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp={denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T (+ b) with a TP-sharded W; subclasses choose the split."""

    tp_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # None: the weight stays in the model dtype (`quantization/apply.py`).
        self.quant_method: LinearMethod | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) with this rank's weight, quantized or not."""
        if self.quant_method is None:
            return dense_linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_dim < loaded.dim():
            loaded = shard_of(loaded, self.tp_dim, self.tp_rank, self.tp_size)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice."""

    tp_dim = 0

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_group().world_size
        super().__init__(input_size, divide(output_size, tp_size, "output_size"), bias)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of one input in one weight, each sharded
    on its own: a rank holds [a_r; b_r; ...], not a slice of the concatenation.
    Shards named in `replicated` are held whole on every rank (a small projection
    that rides along in the larger product instead of a launch of its own)."""

    tp_dim = 0

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        replicated: frozenset[int] = frozenset(),
    ) -> None:
        tp_size = get_tp_group().world_size
        self.output_sizes = output_sizes
        self.replicated = replicated
        self.local_sizes = [
            size if shard in replicated else divide(size, tp_size, "output_size")
            for shard, size in enumerate(output_sizes)
        ]
        super().__init__(input_size, sum(self.local_sizes), bias)
        self.weight.expected_shards = set(range(len(output_sizes)))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            raise ValueError("a merged projection loads one shard at a time (shard_id)")
        offset = sum(self.local_sizes[:shard_id])
        target = param.data.narrow(0, offset, self.local_sizes[shard_id])
        piece = loaded
        if shard_id not in self.replicated:
            piece = shard_of(loaded, 0, self.tp_rank, self.tp_size)
        check_shape(target, piece, f"shard {shard_id}")
        target.copy_(piece)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's output columns per projection, in shard order (views)."""
        return y.split(self.local_sizes, dim=-1)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed (all-reduce)."""

    tp_dim = 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
    ) -> None:
        tp_size = get_tp_group().world_size
        super().__init__(divide(input_size, tp_size, "input_size"), output_size, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() == 1:  # the bias is not split
            default_weight_loader(param, loaded)
        else:
            super().weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.reduce_results:
            y = get_tp_group().all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


def heads_on_rank(num_heads: int, rank: int, tp_size: int) -> range:
    """The heads TP rank `rank` holds when heads are split across `tp_size` ranks.

    With at least as many heads as ranks each rank holds num_heads / tp of them;
    with fewer, heads are replicated and rank r holds head r * num_heads // tp (at
    tp 8 with 4 KV heads, ranks 2h and 2h + 1 both hold head h).
    """
    if num_heads % tp_size and tp_size % num_heads:
        raise ValueError(
            f"{num_heads} heads can be neither split nor replicated evenly across "
            f"tp={tp_size} ranks (one must divide the other)"
        )
    count = max(1, num_heads // tp_size)
    first = rank * num_heads // tp_size
    return range(first, first + count)


class HeadParallelLinear(LinearBase):
    """Several head-structured projections in one weight (e.g. q, k, v), each split
    across TP ranks by whole heads and replicated where it has fewer heads than
    ranks (`heads_on_rank`). `parts` lists (num_heads, head_dim); checkpoint tensor i
    loads as shard i. A rank holds [part0_r; part1_r; ...].
    """

    def __init__(self, input_size: int, parts: list[tuple[int, int]]) -> None:
        tp = get_tp_group()
        self.parts = list(parts)
        self.local_heads = [
            heads_on_rank(heads, tp.rank_in_group, tp.world_size)
            for heads, _ in self.parts
        ]
        self.output_sizes = [
            len(local) * dim for local, (_, dim) in zip(self.local_heads, self.parts)
        ]
        super().__init__(input_size, sum(self.output_sizes), bias=False)
        self.weight.expected_shards = set(range(len(self.parts)))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None or not 0 <= shard_id < len(self.parts):
            raise ValueError(
                f"a head-parallel projection loads one of its {len(self.parts)} "
                f"parts at a time (shard_id), got {shard_id!r}"
            )
        heads, dim = self.parts[shard_id]
        if loaded.dim() != 2 or loaded.shape[0] != heads * dim:
            raise ValueError(
                f"part {shard_id} expects [{heads} heads x {dim}, in], got "
                f"{tuple(loaded.shape)}"
            )
        local = self.local_heads[shard_id]
        piece = loaded[local.start * dim : local.stop * dim]
        offset = sum(self.output_sizes[:shard_id])
        target = param.data.narrow(0, offset, self.output_sizes[shard_id])
        check_shape(target, piece, f"part {shard_id}")
        target.copy_(piece)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """This rank's output per part, each [..., local_heads, head_dim]."""
        pieces = y.split(self.output_sizes, dim=-1)
        return [
            piece.unflatten(-1, (len(local), dim))
            for piece, local, (_, dim) in zip(pieces, self.local_heads, self.parts)
        ]
