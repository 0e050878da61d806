"""MergedColumnParallelLinear: each rank holds its slice of every sharded part and
the whole of every replicated one, in shard order."""

import pytest
import torch

from atom.distributed.parallel_state import build_parallel_state
from atom.model_ops.linear import MergedColumnParallelLinear


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_rank_holds_its_slices_and_the_replicated_parts_whole(tp_rank):
    parts = [torch.randn(4, 3), torch.randn(4, 3), torch.randn(2, 3)]
    with build_parallel_state(tp_rank=tp_rank, tp_size=2):
        layer = MergedColumnParallelLinear(3, [4, 4, 2], replicated=frozenset({2}))
    assert layer.local_sizes == [2, 2, 2]
    for shard, tensor in enumerate(parts):
        layer.weight_loader(layer.weight, tensor, shard)
    rows = slice(2 * tp_rank, 2 * tp_rank + 2)
    expected = torch.cat([parts[0][rows], parts[1][rows], parts[2]])
    assert torch.equal(layer.weight.data, expected)
    a, b, c = layer.split(torch.arange(6.0).view(1, 6))
    assert [t.tolist() for t in (a, b, c)] == [[[0.0, 1.0]], [[2.0, 3.0]], [[4.0, 5.0]]]


def test_a_replicated_part_of_the_wrong_size_is_named():
    with build_parallel_state(tp_rank=0, tp_size=2):
        layer = MergedColumnParallelLinear(3, [4, 2], replicated=frozenset({1}))
    with pytest.raises(ValueError, match="shard 1"):
        layer.weight_loader(layer.weight, torch.randn(1, 3), 1)
    with pytest.raises(ValueError, match="one shard at a time"):
        layer.weight_loader(layer.weight, torch.randn(6, 3))
