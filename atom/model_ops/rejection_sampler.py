"""Verification of one sequence's drafts (dspark.md 5.1 and 5.2).

Stochastic rule: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the
first rejection emit a draw from the residual max(0, p_j - q_j) renormalised (p_j
itself when that mass is 0) and stop; with every draft accepted emit a bonus draw
from p_{T+1}. The emitted tokens are then distributed exactly as the target's.
A greedy draft (q = one-hot) is the special case draft_probs=None.
"""

from __future__ import annotations

import torch


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def _first_false(flags: torch.Tensor) -> int:
    """Index of the first False, or len(flags) when all are True."""
    misses = (~flags).nonzero()
    return int(misses[0, 0]) if misses.numel() else flags.numel()


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor | list[int],
    draft_probs: torch.Tensor | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Return (emitted tokens, number of accepted drafts); len(emitted) = a + 1.

    target_probs: [T+1, V], row j the filtered target distribution predicting the
        position of draft j+1 (row T: the bonus). With greedy=True raw logits do.
    draft_token_ids: [T].
    draft_probs: [T, V] exact distributions the drafts were drawn from, or None for
        a greedy draft. Ignored when greedy.
    greedy: temperature-0 request: accept while the draft is the target argmax.
    generator: drives u ~ U(0, 1) and the draws (on target_probs' device).
    """
    if target_probs.dim() != 2:
        raise ValueError(
            f"target_probs must be [T+1, V], got shape {tuple(target_probs.shape)}"
        )
    device = target_probs.device
    drafts = torch.as_tensor(draft_token_ids, dtype=torch.long, device=device).flatten()
    num_drafts, vocab = drafts.numel(), target_probs.shape[1]
    if target_probs.shape[0] != num_drafts + 1:
        raise ValueError(
            f"target_probs has {target_probs.shape[0]} rows for {num_drafts} drafts; "
            f"expected {num_drafts + 1}"
        )
    if num_drafts and not bool(((drafts >= 0) & (drafts < vocab)).all()):
        raise ValueError(
            f"draft token ids must be in [0, {vocab}), got {drafts.tolist()}"
        )

    if greedy:
        best = target_probs.argmax(dim=-1)
        accepted = _first_false(best[:num_drafts] == drafts)
        return drafts[:accepted].tolist() + [int(best[accepted])], accepted

    p = target_probs.float()
    rows = torch.arange(num_drafts, device=device)
    p_draft = p[rows, drafts]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        if tuple(draft_probs.shape) != (num_drafts, vocab):
            raise ValueError(
                f"draft_probs must be [{num_drafts}, {vocab}], "
                f"got {tuple(draft_probs.shape)}"
            )
        q_draft = draft_probs.to(device=device, dtype=torch.float32)[rows, drafts]
        if bool((q_draft <= 0).any()):
            raise ValueError(
                "a draft token has zero probability under its own draft distribution"
            )
    rand_device = generator.device if generator is not None else device
    u = torch.rand(num_drafts, generator=generator, device=rand_device).to(device)
    # u < p/q without dividing; strict so a token with p = 0 is never accepted.
    accepted = _first_false(u * q_draft < p_draft)
    if accepted == num_drafts:
        bonus = _draw(p[num_drafts], generator)
    else:
        if draft_probs is None:
            q_row = torch.zeros_like(p[accepted])
            q_row[drafts[accepted]] = 1.0
        else:
            q_row = draft_probs[accepted].to(device=device, dtype=torch.float32)
        residual = (p[accepted] - q_row).clamp_min(0)
        if float(residual.sum()) > 0:
            bonus = _draw(residual, generator)
        else:
            bonus = _draw(p[accepted], generator)
    return drafts[:accepted].tolist() + [bonus], accepted
