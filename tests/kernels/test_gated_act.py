"""atom/kernels/gated_act.py against the torch references of atom/model_ops/activation.py."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.activation import SiluAndMul, SiTUAndMul, SwigluOAIAndMul
from tests.kernels.devices import DEVICES

ACTIVATIONS = [
    SiluAndMul(),
    SiTUAndMul(4.0, 25.0),
    SiTUAndMul(1.0),
    SwigluOAIAndMul(1.702, 7.0),
]


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("module", ACTIVATIONS, ids=repr)
def test_kernel_equals_the_reference(device, module):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.gated_act import gated_act_triton

    gen = torch.Generator(device=device).manual_seed(0)
    # Strided rows (a view), a width that is no power of two, large magnitudes
    # that reach the clamps and tanh's flat tails.
    wide = torch.randn(6, 2 * 90 + 4, generator=gen, device=device) * 12
    x = wide[:, : 2 * 90]
    out = gated_act_triton(x, *module.kernel_args())
    assert out.shape == (6, 90) and out.dtype == x.dtype
    torch.testing.assert_close(out, module.reference(x), rtol=1e-5, atol=1e-5)
    if device == "cuda":
        half = x.to(torch.bfloat16)
        torch.testing.assert_close(
            module(half).float(), module.reference(half).float(), rtol=2e-2, atol=2e-2
        )
