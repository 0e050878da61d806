"""ATOM_DISABLE_TRITON=1 sends every op to its torch reference."""

import pytest
import torch

from atom.kernels import DISABLE_ENV, triton_available, triton_installed
from atom.model_ops.activation import SiluAndMul


@pytest.mark.skipif(not triton_installed(), reason="needs triton")
def test_the_switch_turns_the_kernels_off(monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available(device)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert not triton_available(device)
    # The activation then runs its reference, bit for bit.
    x = torch.randn(3, 16, device=device)
    assert torch.equal(SiluAndMul()(x), SiluAndMul().reference(x))
