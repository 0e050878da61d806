"""atom/kernels/kda_gates.py against kda_forget_gate and the sigmoid of beta."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.kda import kda_forget_gate
from tests.kernels.devices import DEVICES

HEADS, DIM = 3, 24


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["kimi-linear", "k3"])
def test_gates_equal_the_reference(device, lower_bound):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.kda_gates import kda_gates_triton

    gen = torch.Generator(device=device).manual_seed(0)
    # A strided projection output, values reaching softplus's linear range (> 20).
    f = torch.randn(4, 2 * HEADS * DIM, generator=gen, device=device) * 12
    f = f[:, : HEADS * DIM]
    a_log = torch.randn(HEADS + 2, generator=gen, device=device)  # K3 pads A_log
    dt_bias = torch.randn(HEADS * DIM, generator=gen, device=device)
    b_logits = torch.randn(4, HEADS, generator=gen, device=device) * 4
    decay, beta = kda_gates_triton(f, a_log, dt_bias, lower_bound, b_logits, HEADS, DIM)
    ref = kda_forget_gate(f.reshape(4, HEADS, DIM), a_log, dt_bias, lower_bound)
    assert decay.shape == (4, HEADS, DIM) and decay.dtype == torch.float32
    torch.testing.assert_close(decay, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beta, torch.sigmoid(b_logits))
