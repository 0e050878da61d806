import math

import pytest
import torch
import torch.nn.functional as F

from atom.model_ops.kda import (
    causal_conv1d,
    chunk_kda,
    conv_state_after_each_row,
    kda_forget_gate,
    kda_output_norm_gate,
    l2_normalize,
    recurrent_kda,
)
from atom.model_ops.kda_backend import fla_available

HEADS, KEY_DIM, VALUE_DIM = 2, 32, 16


def make_inputs(tokens: int, with_state: bool, lower_bound: float | None, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = l2_normalize(randn(tokens, HEADS, KEY_DIM))
    k = l2_normalize(randn(tokens, HEADS, KEY_DIM))
    v = randn(tokens, HEADS, VALUE_DIM)
    a_log = torch.empty(HEADS).uniform_(1, 16, generator=gen).log()
    dt_bias = randn(HEADS * KEY_DIM) * 0.5
    g = kda_forget_gate(randn(tokens, HEADS, KEY_DIM), a_log, dt_bias, lower_bound)
    beta = torch.rand(tokens, HEADS, generator=gen)
    state = randn(1, HEADS, VALUE_DIM, KEY_DIM) if with_state else None
    # The math runs on batches: one sequence of `tokens` rows.
    return q[None], k[None], v[None], g[None], beta[None], state


def assert_close_relative(actual, expected, tol):
    scale = expected.abs().max().clamp_min(1e-6)
    assert float((actual - expected).abs().max() / scale) < tol


@pytest.mark.parametrize("tokens", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunk_matches_token_loop(tokens, with_state, lower_bound):
    inputs = make_inputs(tokens, with_state, lower_bound)
    o_ref, state_ref = recurrent_kda(*inputs)
    o, state = chunk_kda(*inputs)
    assert o.dtype == torch.float32 and o.shape == (1, tokens, HEADS, VALUE_DIM)
    assert state.shape == (1, HEADS, VALUE_DIM, KEY_DIM)
    assert_close_relative(o, o_ref, 1e-5)
    assert_close_relative(state, state_ref, 1e-5)


@pytest.mark.parametrize("chunk_size", [1, 7, 20, 33])
def test_chunk_size_does_not_change_result(chunk_size):
    inputs = make_inputs(70, True, -5.0, seed=1)
    o_ref, state_ref = recurrent_kda(*inputs)
    o, state = chunk_kda(*inputs, chunk_size=chunk_size)
    assert_close_relative(o, o_ref, 1e-5)
    assert_close_relative(state, state_ref, 1e-5)


def test_chunk_is_stable_under_very_strong_decay():
    q, k, v, _, beta, state = make_inputs(100, True, None, seed=2)
    # Cumulative decay reaches -20000 inside one chunk: naive exp(-G) would overflow.
    g = torch.full((1, 100, HEADS, KEY_DIM), -300.0)
    g[:, ::3] = -1e-3
    o, final = chunk_kda(q, k, v, g, beta, state)
    o_ref, final_ref = recurrent_kda(q, k, v, g, beta, state)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert_close_relative(o, o_ref, 1e-5)
    assert_close_relative(final, final_ref, 1e-5)


def test_prefill_in_pieces_equals_one_call():
    q, k, v, g, beta, state = make_inputs(90, True, -5.0, seed=3)
    o_full, final_full = chunk_kda(q, k, v, g, beta, state)
    head, tail = (slice(None), slice(None, 37)), (slice(None), slice(37, None))
    o_a, mid = chunk_kda(q[head], k[head], v[head], g[head], beta[head], state)
    o_b, final = chunk_kda(q[tail], k[tail], v[tail], g[tail], beta[tail], mid)
    assert_close_relative(torch.cat([o_a, o_b], dim=1), o_full, 1e-5)
    assert_close_relative(final, final_full, 1e-5)


@pytest.mark.skipif(
    fla_available(), reason="with fla installed transformers runs fla's CUDA kernel"
)
def test_recurrent_matches_transformers_token_loop():
    modeling = pytest.importorskip(
        "transformers.models.kimi_linear.modeling_kimi_linear"
    )
    q, k, v, g, beta, state = make_inputs(12, True, None, seed=4)
    o_ref, state_ref = modeling.recurrent_kimi_delta_attention(
        q, k, v, g, beta,
        initial_state=state.transpose(2, 3),  # transformers keeps [h, Dk, Dv]
        output_final_state=True,
    )  # fmt: skip
    o, final = recurrent_kda(q, k, v, g, beta, state)
    assert_close_relative(o, o_ref, 1e-5)
    assert_close_relative(final, state_ref.transpose(2, 3), 1e-5)


def test_all_states_are_prefix_states():
    inputs = make_inputs(6, True, -5.0, seed=5)
    o, final, all_states = recurrent_kda(*inputs, return_all_states=True)
    assert all_states.shape == (1, 6, HEADS, VALUE_DIM, KEY_DIM)
    assert torch.equal(all_states[:, -1], final)
    q, k, v, g, beta, state = inputs
    three = (slice(None), slice(None, 3))
    _, after_three = recurrent_kda(
        q[three], k[three], v[three], g[three], beta[three], state
    )
    torch.testing.assert_close(all_states[:, 2], after_three)
    o_plain, _ = recurrent_kda(*inputs)
    torch.testing.assert_close(o, o_plain)


def test_caller_state_is_not_modified():
    inputs = make_inputs(10, True, -5.0, seed=6)
    before = inputs[-1].clone()
    recurrent_kda(*inputs)
    chunk_kda(*inputs)
    assert torch.equal(inputs[-1], before)


def test_state_layout_is_checked():
    q, k, v, g, beta, _ = make_inputs(3, False, -5.0)
    key_first = torch.zeros(1, HEADS, KEY_DIM, VALUE_DIM)
    with pytest.raises(ValueError, match="value-first"):
        chunk_kda(q, k, v, g, beta, key_first)


def test_l2_normalize_uses_additive_eps():
    x = torch.tensor([[3.0, 4.0]])
    expected = x / math.sqrt(25 + 1e-6)
    torch.testing.assert_close(l2_normalize(x.bfloat16()), expected, atol=2e-2, rtol=0)
    torch.testing.assert_close(l2_normalize(x), expected)


def test_bounded_gate_formula_and_range():
    gen = torch.Generator().manual_seed(7)
    f = torch.randn(9, 3, 4, generator=gen) * 3
    a_log = torch.randn(5, generator=gen)  # more entries than heads: first 3 used
    dt_bias = torch.randn(3, 4, generator=gen)
    g = kda_forget_gate(f.bfloat16(), a_log.view(1, 1, 5, 1), dt_bias, -5.0)
    expected = -5.0 * torch.sigmoid(
        a_log[:3].exp().view(1, 3, 1) * (f.bfloat16().float() + dt_bias)
    )
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, expected)
    assert (g > -5.0).all() and (g < 0).all()


def test_softplus_gate_formula():
    f = torch.tensor([[[-30.0, -1.0, 0.0, 19.0, 25.0, 60.0]]])
    a_log = torch.tensor([0.7])
    dt_bias = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    g = kda_forget_gate(f, a_log, dt_bias, None)
    pre = f + 0.5
    softplus = torch.where(pre > 20, pre, torch.log1p(torch.exp(pre)))
    torch.testing.assert_close(g, -math.exp(0.7) * softplus)
    assert (g <= 0).all()


def test_gate_rejects_bad_shapes():
    with pytest.raises(ValueError, match="dt_bias"):
        kda_forget_gate(torch.zeros(2, 3, 4), torch.zeros(3), torch.zeros(11), -5.0)
    with pytest.raises(ValueError, match="A_log"):
        kda_forget_gate(torch.zeros(2, 3, 4), torch.zeros(2), torch.zeros(12), -5.0)


def direct_conv(x, weight, state):
    """One sequence: x [T, C], state [C, K-1]."""
    padded = torch.cat([state.t(), x], dim=0).t().unsqueeze(0)
    return F.silu(F.conv1d(padded, weight.unsqueeze(1), groups=x.shape[1]))[0].t()


def test_causal_conv_matches_conv1d_over_state_and_input():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 7, 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    state = torch.randn(1, 6, 3, generator=gen)
    y, new_state = causal_conv1d(x, weight, state)
    torch.testing.assert_close(y[0], direct_conv(x[0], weight, state[0]))
    torch.testing.assert_close(new_state[0], x[0, -3:].t())
    y0, _ = causal_conv1d(x, weight.unsqueeze(1), None)  # checkpoint [C, 1, K] form
    torch.testing.assert_close(y0[0], direct_conv(x[0], weight, torch.zeros(6, 3)))


def test_causal_conv_in_pieces_equals_one_call():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 9, 5, generator=gen)
    weight = torch.randn(5, 4, generator=gen)
    y_full, state_full = causal_conv1d(x, weight)
    pieces, state = [], None
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4), slice(4, 9)):
        y, state = causal_conv1d(x[:, rows], weight, state)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=1), y_full)
    torch.testing.assert_close(state, state_full)


def test_causal_conv_of_a_padded_batch_equals_each_sequence_alone():
    gen = torch.Generator().manual_seed(12)
    weight = torch.randn(5, 4, generator=gen)
    states = torch.randn(2, 5, 3, generator=gen)
    lengths = [6, 2]
    x = torch.randn(2, 6, 5, generator=gen)
    x[1, 2:] = 0  # padding rows
    y, new_states = causal_conv1d(x, weight, states, torch.tensor(lengths))
    for b, length in enumerate(lengths):
        alone, alone_state = causal_conv1d(
            x[b : b + 1, :length], weight, states[b : b + 1]
        )
        torch.testing.assert_close(y[b, :length], alone[0])
        torch.testing.assert_close(new_states[b], alone_state[0])


def test_padded_rows_leave_the_recurrent_state_untouched():
    q, k, v, g, beta, state = make_inputs(9, True, -5.0, seed=13)
    padded = [t.clone() for t in (q, k, v, g, beta)]
    padded[3][:, 5:] = 0  # g = 0: no decay
    padded[4][:, 5:] = 0  # beta = 0: no write
    short = (slice(None), slice(None, 5))
    _, expected = recurrent_kda(*(t[short] for t in (q, k, v, g, beta)), state)
    for kernel in (recurrent_kda, chunk_kda):
        _, final = kernel(*padded, state)
        assert_close_relative(final, expected, 1e-5)


def test_causal_conv_keeps_input_dtype():
    x = torch.randn(1, 4, 3).bfloat16()
    y, state = causal_conv1d(x, torch.randn(3, 4), torch.zeros(1, 3, 3).bfloat16())
    assert y.dtype == torch.bfloat16 and state.dtype == torch.bfloat16


def test_conv_state_after_each_row_matches_splitting():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(1, 5, 4, generator=gen)
    start = torch.randn(1, 4, 3, generator=gen)
    weight = torch.randn(4, 4, generator=gen)
    per_row = conv_state_after_each_row(x, start)
    assert per_row.shape == (1, 5, 4, 3)
    for j in range(5):
        _, expected = causal_conv1d(x[:, : j + 1], weight, start)
        torch.testing.assert_close(per_row[:, j], expected)


def test_output_norm_gate_matches_explicit_computation():
    gen = torch.Generator().manual_seed(11)
    o = torch.randn(3, 2, 8, generator=gen)
    weight = torch.randn(8, generator=gen)
    gate = torch.randn(3, 16, generator=gen)
    y = kda_output_norm_gate(o, weight, gate, eps=1e-5)
    head1 = o[1, 1] / torch.sqrt(o[1, 1].pow(2).mean() + 1e-5) * weight
    torch.testing.assert_close(y[1, 8:], head1 * torch.sigmoid(gate[1, 8:]))
    y3 = kda_output_norm_gate(o, weight, gate.view(3, 2, 8), eps=1e-5)
    torch.testing.assert_close(y3, y)
