"""atom/kernels/moe_route_sort.py against the three references it replaces:
`select_experts_reference`, `align_to_experts` and the tile list `expert_tiles`."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.grouped_experts import align_to_experts
from atom.model_ops.moe_router import select_experts_reference
from tests.kernels.devices import DEVICES

# (tokens, top_k, experts, groups, kept groups, scoring): a decode token, the most
# tokens it takes, experts off a power of two, grouped selection, softmax.
CASES = [
    (1, 8, 32, 1, 1, "sigmoid"),
    (4, 8, 32, 1, 1, "sigmoid"),
    (3, 4, 24, 1, 1, "sigmoid"),
    (3, 6, 64, 8, 4, "sigmoid"),
    (2, 2, 16, 1, 1, "softmax"),
]


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,top_k,experts,groups,kept,scoring", CASES)
@pytest.mark.parametrize("block_m", [16, 64])
def test_route_and_sort_equals_the_references(
    device, tokens, top_k, experts, groups, kept, scoring, block_m
):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.expert_gemm import expert_tiles
    from atom.kernels.moe_route_sort import route_and_sort_triton

    gen = torch.Generator().manual_seed(tokens * experts)
    logits = torch.randn(tokens, experts, generator=gen)
    bias = torch.randn(experts, generator=gen) / 10
    settings = (top_k, groups, kept, True, 2.5, scoring)
    weights, ids, token_of, position, ends, tile_expert, tile_row = (
        route_and_sort_triton(logits.to(device), bias.to(device), *settings, block_m)
    )
    ref_weights, ref_ids = select_experts_reference(logits, bias, *settings)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-5, atol=1e-6)
    ref_token_of, ref_position, ref_ends = align_to_experts(ref_ids, experts)
    assert torch.equal(token_of.cpu().long(), ref_token_of)
    assert torch.equal(position.cpu().long(), ref_position)
    assert torch.equal(ends.cpu(), ref_ends)
    ref_expert, ref_row = expert_tiles(ref_ends, tokens * top_k, block_m)
    assert torch.equal(tile_expert.cpu(), ref_expert)
    real = ref_expert < experts  # a padding tile's row is never read
    assert torch.equal(tile_row.cpu()[real], ref_row[real])


@pytest.mark.kernels
def test_a_step_past_the_bound_is_refused():
    if not triton_available("cpu"):
        pytest.skip("triton cannot run here")
    from atom.kernels.moe_route_sort import ROUTE_SORT_MAX_TOKENS, route_and_sort_triton

    logits = torch.zeros(ROUTE_SORT_MAX_TOKENS + 1, 32)
    with pytest.raises(ValueError, match="tokens"):
        route_and_sort_triton(logits, None, 8, 1, 1, True, 1.0, "sigmoid", 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 5])
def test_the_routers_sort_serves_the_experts_as_a_fresh_sort_does(tokens):
    """On CUDA `choose_experts` sorts a step of up to 4 tokens in its launch (5
    take the separate kernels); the experts' output is the same either way."""
    from atom.model_ops.activation import get_act_and_mul
    from atom.model_ops.grouped_experts import ExpertChoice, grouped_expert_mlp
    from atom.model_ops.moe_router import choose_experts

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts, hidden, inner = 32, 64, 48
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    choice = choose_experts(logits, None, top_k=8)
    assert (choice.sorted_pairs is not None) == (tokens <= 4)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen)
    w13 = torch.randn(experts, 2 * inner, hidden, device="cuda", generator=gen) / 8
    w2 = torch.randn(experts, hidden, inner, device="cuda", generator=gen) / 7
    act = get_act_and_mul("silu")
    fresh = ExpertChoice(choice.weights, choice.ids)
    torch.testing.assert_close(
        grouped_expert_mlp(x, choice, w13, w2, act, "triton"),
        grouped_expert_mlp(x, fresh, w13, w2, act, "triton"),
    )
