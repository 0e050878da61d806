import pytest
import torch

from atom.model_ops.moe_router import choose_experts


def select_experts(*args, **kwargs):
    """(weights, ids) of `choose_experts`."""
    choice = choose_experts(*args, **kwargs)
    return choice.weights, choice.ids


def test_weights_are_renormalised_sigmoid_scores():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    weights, ids = select_experts(logits, None, top_k=2)
    assert ids.tolist() == [[3, 0]] and ids.dtype == torch.long
    chosen = torch.sigmoid(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(weights[0], chosen / chosen.sum())
    raw, _ = select_experts(logits, None, top_k=2, renormalize=False)
    torch.testing.assert_close(raw[0], chosen)


def test_bias_changes_choice_not_weights():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    bias = torch.tensor([0.0, 5.0, 0.0, 0.0])
    weights, ids = select_experts(logits, bias, top_k=2, renormalize=False)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights[0], torch.sigmoid(torch.tensor([-1.0, 3.0])))


def test_grouped_selection_masks_weak_groups():
    # 4 groups of 2; group 0 holds the single best expert but a weak partner.
    logits = torch.tensor([[6.0, -6.0, 1.0, 1.0, 2.0, 2.0, -3.0, -3.0]])
    _, ungrouped = select_experts(logits, None, top_k=2)
    assert 0 in ungrouped[0].tolist()
    weights, ids = select_experts(
        logits, None, top_k=2, num_expert_group=4, topk_group=2, renormalize=False
    )
    assert sorted(ids[0].tolist()) == [4, 5]  # groups 1 and 2 kept, group 2 best
    torch.testing.assert_close(weights[0], torch.sigmoid(torch.tensor([2.0, 2.0])))
    _, ids3 = select_experts(logits, None, top_k=4, num_expert_group=4, topk_group=2)
    assert sorted(ids3[0].tolist()) == [2, 3, 4, 5]


def test_scaling_factor_multiplies_weights():
    logits = torch.randn(5, 16).bfloat16()
    bias = torch.randn(16)
    w1, ids1 = select_experts(logits, bias, top_k=4)
    w2, ids2 = select_experts(logits, bias, top_k=4, routed_scaling_factor=2.446)
    assert torch.equal(ids1, ids2) and w1.dtype == torch.float32
    torch.testing.assert_close(w2, w1 * 2.446)
    torch.testing.assert_close(w1.sum(dim=-1), torch.ones(5))


def test_softmax_scoring():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    weights, ids = select_experts(
        logits, None, top_k=1, renormalize=False, scoring="softmax"
    )
    assert ids.tolist() == [[2]]
    torch.testing.assert_close(weights[0], torch.softmax(logits[0], 0)[2:])


def test_matches_transformers_router():
    modeling = pytest.importorskip(
        "transformers.models.kimi_linear.modeling_kimi_linear"
    )
    config_cls = pytest.importorskip("transformers").KimiLinearConfig
    config = config_cls(
        hidden_size=16,
        num_experts=8,
        num_experts_per_token=3,
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.446,
        moe_renormalize=True,
    )
    router = modeling.KimiLinearTopkRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.1)
    x = torch.randn(6, 16, generator=gen)
    logits, ref_weights, ref_ids = router(x)
    weights, ids = select_experts(
        logits,
        router.e_score_correction_bias,
        top_k=3,
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.446,
    )
    order = ref_ids.argsort(dim=-1)
    mine = ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, mine), ref_ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, mine), ref_weights.gather(1, order))


def test_rejects_bad_grouping():
    with pytest.raises(ValueError, match="num_expert_group"):
        select_experts(torch.zeros(1, 6), None, top_k=1, num_expert_group=4)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(
            torch.zeros(1, 8), None, top_k=5, num_expert_group=4, topk_group=2
        )
