"""Verification of every sequence's drafts at once.

Stochastic rule (temperature > 0): accept d_j with probability min(1, p_j(d_j) /
q_j(d_j)); at the first rejection emit a draw from the residual max(0, p_j - q_j)
(p_j itself when that mass is 0) and stop; with every draft accepted emit a bonus
draw from p_{T+1}. The emitted tokens are then distributed exactly as the
target's. Greedy rule (temperature 0): accept while the draft is the target
argmax, then emit the argmax, which is exactly what target-only greedy decoding
emits.

Sequences carry different draft counts: rows are padded to the batch's largest T
and masked. A sequence with no drafts emits its "bonus" draw from row 0, on the
TARGET stream, so it gets the token plain sampling would give it.
"""

from __future__ import annotations

import torch

from atom.model_ops.counter_random import Stream, uniform
from atom.model_ops.sampler import draw_tokens, filtered_probs
from atom.model_ops.sampling_metadata import SamplingMetadata


def _leading_true(flags: torch.Tensor) -> torch.Tensor:
    """[S] the number of leading True entries of each row of [S, T]."""
    return flags.long().cumprod(dim=-1).sum(dim=-1)


def verify_drafts(
    target_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(emitted [S, T+1] long, accepted [S] long); row s emits accepted[s] + 1
    tokens: its first accepted[s] drafts, then the correction or bonus token.

    target_logits: [S, T+1, V]; row j of sequence s predicts the position of its
        draft j+1 (row num_drafts[s] predicts the bonus position).
    draft_ids: [S, T]; entries past num_drafts[s] are ignored.
    num_drafts: [S] long, each in [0, T].
    draft_probs: [S, T, V] the exact distributions the drafts of temperature > 0
        rows were drawn from (other rows are ignored), or None when every draft
        was greedy (q = one-hot of the draft).
    sampling: settings, seeds and positions (of each sequence's first draft).
    """
    num_seqs, width = draft_ids.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (num_seqs, width + 1):
        raise ValueError(
            f"target_logits must be [{num_seqs}, {width + 1}, V], got "
            f"{tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (num_seqs, width, vocab):
        raise ValueError(
            f"draft_probs must be [{num_seqs}, {width}, {vocab}], got "
            f"{tuple(draft_probs.shape)}"
        )
    if sampling.num_seqs != num_seqs:
        raise ValueError(
            f"sampling metadata has {sampling.num_seqs} rows for {num_seqs} sequences"
        )
    seqs = torch.arange(num_seqs, device=draft_ids.device)
    valid = torch.arange(width, device=draft_ids.device) < num_drafts.unsqueeze(1)

    best = target_logits.argmax(dim=-1)
    accepted = _leading_true((best[:, :width] == draft_ids) & valid)
    final = best[seqs, accepted]
    if not sampling.all_greedy:
        stochastic, drawn = _stochastic(
            target_logits, draft_ids, num_drafts, draft_probs, sampling, valid
        )
        accepted = torch.where(sampling.greedy, accepted, stochastic)
        final = torch.where(sampling.greedy, final, drawn)
    emitted = torch.cat([draft_ids, draft_ids.new_zeros(num_seqs, 1)], dim=1)
    emitted.scatter_(1, accepted.unsqueeze(1), final.unsqueeze(1))
    return emitted, accepted


def _stochastic(
    target_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingMetadata,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [S], token emitted after them [S]) under the stochastic rule."""
    num_seqs, width = draft_ids.shape
    vocab = target_logits.shape[-1]

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return values.unsqueeze(1).expand(-1, width + 1).reshape(-1)

    p = filtered_probs(
        target_logits.reshape(-1, vocab),
        per_row(sampling.temperatures),
        per_row(sampling.top_ks),
        per_row(sampling.top_ps),
        sampling.uses_top_k,
        sampling.uses_top_p,
    ).view(num_seqs, width + 1, vocab)
    p_draft = p[:, :width].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float().gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    offsets = torch.arange(width, device=draft_ids.device)
    u = uniform(
        sampling.seeds.unsqueeze(1),
        sampling.positions.unsqueeze(1) + offsets,
        Stream.ACCEPT,
    )
    # u < p/q without dividing; strict so a token with p = 0 is never accepted.
    accepted = _leading_true((u * q_draft < p_draft) & valid)

    seqs = torch.arange(num_seqs, device=draft_ids.device)
    p_stop = p[seqs, accepted]
    rejected = (accepted < num_drafts).unsqueeze(1)
    stop_draft = accepted.clamp(max=max(width - 1, 0))
    if width == 0:
        q_stop = torch.zeros_like(p_stop)
    elif draft_probs is None:
        q_stop = torch.zeros_like(p_stop).scatter_(
            1, draft_ids[seqs, stop_draft].unsqueeze(1), 1.0
        )
    else:
        q_stop = draft_probs[seqs, stop_draft].float()
    # After full acceptance q_stop is 0 and the residual is p_{T+1} itself.
    residual = (p_stop - torch.where(rejected, q_stop, 0.0)).clamp_min(0)
    has_mass = residual.sum(dim=1, keepdim=True) > 0
    weights = torch.where(has_mass, residual, p_stop)
    streams = torch.where(num_drafts == 0, int(Stream.TARGET), int(Stream.RESIDUAL))
    drawn = draw_tokens(weights, sampling.seeds, sampling.positions + accepted, streams)
    return accepted, drawn
