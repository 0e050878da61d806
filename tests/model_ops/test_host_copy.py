"""atom/model_ops/host_copy.py: a step's host lists reach the device in one copy
per dtype, each field with its own shape and values."""

import pytest
import torch

from atom.model_ops import host_copy
from atom.model_ops.host_copy import hosts_to_device


def test_fields_come_back_in_order_with_one_copy_per_dtype(monkeypatch):
    copies = []
    pinned_copy = host_copy._pinned_copy
    monkeypatch.setattr(
        host_copy,
        "_pinned_copy",
        lambda host, device: copies.append(host.dtype) or pinned_copy(host, device),
    )
    fields = [
        ([0.5, 0.0], torch.float32, (2,)),
        ([3, 4, 5], torch.long, (3,)),
        ([], torch.long, (0,)),
        ([1, 2, 3, 0], torch.long, (2, 2)),
        ([], torch.long, (2, 0)),
        ([1.0], torch.float32, (1,)),
    ]
    placed = hosts_to_device(fields, "cpu")
    assert sorted(copies, key=str) == [torch.float32, torch.int64]
    for tensor, (values, dtype, shape) in zip(placed, fields, strict=True):
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape
        assert torch.equal(tensor, torch.tensor(values, dtype=dtype).reshape(shape))


def test_a_field_whose_values_miss_its_shape_is_refused():
    with pytest.raises(ValueError, match="3 values for a tensor of shape"):
        hosts_to_device([([1, 2, 3], torch.long, (2, 2))], "cpu")
