import pytest
import torch
import torch.nn.functional as F

from atom.model_ops.activation import SiluAndMul, SiTUAndMul, get_act_and_mul


def test_silu_and_mul_is_gate_first():
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_situ_with_large_beta_tends_to_swiglu():
    x = torch.randn(4, 2, 12) * 3
    out = SiTUAndMul(beta=1e6)(x)
    torch.testing.assert_close(
        out, F.silu(x[..., :6]) * x[..., 6:], rtol=1e-5, atol=1e-5
    )


def test_situ_formula_with_linear_beta():
    x = torch.tensor([[-8.0, 0.5, 30.0, 2.0, -100.0, 40.0]])
    out = SiTUAndMul(beta=4.0, linear_beta=25.0)(x)
    gate, up = x[:, :3], x[:, 3:]
    act = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate)
    expected = act * 25.0 * torch.tanh(up / 25.0)
    torch.testing.assert_close(out, expected)
    # The bounded gate caps the activation at beta; SiLU would give ~30.
    assert out[0, 2] / (25 * torch.tanh(torch.tensor(40.0 / 25))) < 4.0 + 1e-6


def test_situ_returns_input_dtype():
    x = torch.randn(2, 8).bfloat16()
    assert SiTUAndMul(4.0, 25.0)(x).dtype == torch.bfloat16


def test_get_act_and_mul():
    assert isinstance(get_act_and_mul("silu", None, None), SiluAndMul)
    assert isinstance(get_act_and_mul("swiglu", None, None), SiluAndMul)
    situ = get_act_and_mul("situ", 4.0, 25.0)
    assert (
        isinstance(situ, SiTUAndMul) and situ.beta == 4.0 and situ.linear_beta == 25.0
    )
    assert get_act_and_mul("situ", None, None).beta == 1.0


def test_unknown_activation_names_allowed_values():
    with pytest.raises(ValueError, match="situ"):
        get_act_and_mul("gelu", None, None)
