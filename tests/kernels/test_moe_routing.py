"""atom/kernels/moe_routing.py against select_experts_reference of
atom/model_ops/moe_router.py."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.moe_router import select_experts_reference
from tests.kernels.devices import DEVICES

# (experts, top_k, groups, kept groups, scoring, bias, renormalize, scale)
SETTINGS = [
    (32, 8, 1, 1, "sigmoid", True, True, 2.5),  # Kimi Linear's shape
    (24, 6, 1, 1, "sigmoid", True, False, 1.0),  # neither a power of two
    (64, 8, 8, 4, "sigmoid", True, True, 2.827),  # grouped, half the groups kept
    (12, 3, 3, 2, "softmax", False, True, 1.0),  # three groups, softmax
    (16, 4, 4, 1, "sigmoid", True, True, 1.0),  # one group kept of four
]


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_selection_equals_the_reference(device, setting):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.moe_routing import select_experts_triton

    experts, top_k, groups, kept, scoring, with_bias, renormalize, scale = setting
    gen = torch.Generator(device=device).manual_seed(experts + top_k)
    logits = torch.randn(7, experts, generator=gen, device=device) * 3
    bias = torch.randn(experts, generator=gen, device=device) if with_bias else None
    args = (logits, bias, top_k, groups, kept, renormalize, scale, scoring)
    weights, ids = select_experts_triton(*args)
    ref_weights, ref_ids = select_experts_reference(*args)
    assert ids.dtype == ref_ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
def test_ties_pick_the_lower_expert_first(device):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.moe_routing import select_experts_triton

    # Equal logits and no bias: every expert ties, so ids come out in order.
    logits = torch.zeros(3, 16, device=device)
    weights, ids = select_experts_triton(logits, None, 4, 1, 1, True, 1.0, "sigmoid")
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    torch.testing.assert_close(weights, torch.full((3, 4), 0.25, device=device))
