import torch

from atom.utils.arithmetic import ceil_div


def test_ceil_div_on_ints_and_tensors():
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    counts = torch.tensor([0, 1, 16, 17])
    assert ceil_div(counts, 16).tolist() == [0, 1, 1, 2]
