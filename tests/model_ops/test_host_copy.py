"""atom/model_ops/host_copy.py: a step's host lists reach the device in one copy
per dtype, each field with its own shape and values."""

import pytest
import torch

from atom.model_ops import host_copy
from atom.model_ops.host_copy import hosts_to_device


def test_fields_come_back_in_order_with_one_copy_per_dtype(monkeypatch):
    copies = []
    copy_to_device = host_copy.copy_to_device
    monkeypatch.setattr(
        host_copy,
        "copy_to_device",
        lambda host, device: copies.append(host.dtype) or copy_to_device(host, device),
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging is CUDA's")
def test_staged_copies_queued_behind_a_busy_stream_keep_their_values():
    """More copies than the staging has buffers, all queued behind a long kernel:
    each buffer is refilled only once the device has read it, and changing a host
    tensor after its copy was issued does not reach the device."""
    hosts = [torch.arange(i, i + 1000, dtype=torch.long) for i in range(40)]
    torch.cuda._sleep(50_000_000)  # keeps the stream busy while the host queues
    placed = [host_copy.copy_to_device(host, "cuda") for host in hosts]
    expected = [host.clone() for host in hosts]
    for host in hosts:
        host.zero_()
    for tensor, values in zip(placed, expected, strict=True):
        assert torch.equal(tensor.cpu(), values)
