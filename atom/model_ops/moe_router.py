"""Top-k expert selection (noaux_tc; docs/kimi_k3.md, MoE).

Sigmoid (or softmax) scores pick experts after adding the load-balancing correction
bias; the mixing weights are the unbiased scores. On CUDA one Triton program per token
does it all (`kernels/moe_routing.py`); this torch code is its reference.
"""

import torch

from atom.kernels import triton_available
from atom.model_ops.grouped_experts import ExpertChoice, ExpertGroups, SortedPairs

_SCORINGS = ("sigmoid", "softmax")


def check_routing(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    scoring: str,
) -> None:
    """Raise ValueError naming the first routing setting these logits cannot take."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {router_logits.shape}")
    num_experts = router_logits.shape[1]
    if scoring not in _SCORINGS:
        raise ValueError(f"scoring {scoring!r}; allowed: {', '.join(_SCORINGS)}")
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(
            f"num_expert_group={num_expert_group} must divide {num_experts} experts"
        )
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, {num_expert_group}]")
    per_group = num_experts // num_expert_group
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(
            f"top_k={top_k} must be in [1, {topk_group * per_group}] "
            "(experts in the kept groups)"
        )
    if correction_bias is not None and correction_bias.numel() != num_experts:
        raise ValueError(
            f"correction_bias has {correction_bias.numel()} entries, "
            f"expected {num_experts}"
        )


def choose_experts(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
) -> ExpertChoice:
    """The top-k choice for router_logits [T, E]: weights [T, k] fp32 and expert
    ids [T, k] int64.

    With groups, a group's score is the sum of its two best choice scores and only
    the best `topk_group` groups stay eligible. On CUDA one program per token
    chooses (`kernels/moe_routing.py`); a step of a few tokens
    (`ROUTE_SORT_MAX_TOKENS`) is also sorted by expert, with the grouped GEMM's tile
    list, in the same launch (`kernels/moe_route_sort.py`).
    """
    check_routing(
        router_logits, correction_bias, top_k, num_expert_group, topk_group, scoring
    )
    args = (
        router_logits,
        correction_bias,
        top_k,
        num_expert_group,
        topk_group,
        renormalize,
        routed_scaling_factor,
        scoring,
    )
    if not (router_logits.is_cuda and triton_available(router_logits.device)):
        return ExpertChoice(*select_experts_reference(*args))
    from atom.kernels.expert_gemm import decode_block_m
    from atom.kernels.moe_route_sort import ROUTE_SORT_MAX_TOKENS, route_and_sort_triton
    from atom.kernels.moe_routing import select_experts_triton

    num_tokens, num_experts = router_logits.shape
    if not 0 < num_tokens <= ROUTE_SORT_MAX_TOKENS:
        return ExpertChoice(*select_experts_triton(*args))
    block_m = decode_block_m(num_tokens * top_k, num_experts)
    weights, ids, token_of, position, ends, tile_expert, tile_row = (
        route_and_sort_triton(*args, block_m)
    )
    groups = ExpertGroups(ends, {block_m: (tile_expert, tile_row)})
    return ExpertChoice(weights, ids, SortedPairs(token_of, position, groups))


def select_experts_reference(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    scoring: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`choose_experts`' weights and ids in torch ops, for arguments it has
    validated."""
    num_experts = router_logits.shape[1]
    per_group = num_experts // num_expert_group
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores
    if correction_bias is not None:
        choice = scores + correction_bias.float().reshape(1, num_experts)
    if num_expert_group > 1 and topk_group < num_expert_group:
        grouped = choice.view(-1, num_expert_group, per_group)
        best_two = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        kept_groups = best_two.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(best_two, dtype=torch.bool)
        keep.scatter_(1, kept_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = choice.topk(top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
