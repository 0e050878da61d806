"""Decoding with DSpark's Markov head over the block's base logits.

For k = 1..T: z_k = U_k + W1[x_{k-1}] W2^T in fp32 (x_0 = the anchor); greedy
requests take argmax z_k (lowest index on ties), sampled ones draw x_k from
q_k = filtered_probs(z_k) on the DRAFT stream at x_k's position and keep q_k for
lossless verification. The T positions are sequential; each is one batched step
over all sequences, and the backbone ran once for all T rows.

TP: every rank holds the same logits and computes the same counter-based
uniforms, so drafts agree on all ranks without a broadcast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from atom.model_ops.counter_random import Stream
from atom.model_ops.sampler import draw_tokens, filtered_probs
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.spec_decode.draft_output import DraftOutput


def greedy_drafts(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    markov_bias: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """[S, T] argmax drafts of an all-greedy batch: device work only, so the block
    pass's CUDA graph captures it too (`block_pass_graphs.py`)."""
    num_seqs, width, _ = base_logits.shape
    drafts = torch.empty(num_seqs, width, dtype=torch.long, device=base_logits.device)
    prev = anchor_ids
    for k in range(width):
        prev = (base_logits[:, k].float() + markov_bias(prev)).argmax(dim=-1)
        drafts[:, k] = prev
    return drafts


def markov_decode(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    anchor_positions: torch.Tensor,
    markov_bias: Callable[[torch.Tensor], torch.Tensor],
    sampling: SamplingMetadata,
) -> DraftOutput:
    """Drafts for positions anchor_positions + 1..T of each sequence.

    base_logits: [S, T, V]; anchor_ids, anchor_positions: [S] on the same device.
    Greedy requests in a mixed batch get q = one-hot(draft), the exact law of a
    greedy draft.
    """
    num_seqs, width, _ = base_logits.shape
    if anchor_ids.shape != (num_seqs,) or anchor_positions.shape != (num_seqs,):
        raise ValueError(
            f"{num_seqs} sequences need anchor ids and positions of shape "
            f"({num_seqs},), got {tuple(anchor_ids.shape)} and "
            f"{tuple(anchor_positions.shape)}"
        )
    if sampling.num_seqs != num_seqs:
        raise ValueError(
            f"sampling metadata has {sampling.num_seqs} rows for {num_seqs} sequences"
        )
    if sampling.all_greedy:
        return DraftOutput(greedy_drafts(base_logits, anchor_ids, markov_bias), None)
    drafts = torch.empty(num_seqs, width, dtype=torch.long, device=base_logits.device)
    probs = torch.empty_like(base_logits, dtype=torch.float32)
    greedy = sampling.greedy.unsqueeze(1)
    prev = anchor_ids
    for k in range(width):
        z = base_logits[:, k].float() + markov_bias(prev)
        q = filtered_probs(
            z,
            sampling.temperatures,
            sampling.top_ks,
            sampling.top_ps,
            sampling.uses_top_k,
            sampling.uses_top_p,
        )
        drawn = draw_tokens(q, sampling.seeds, anchor_positions + k + 1, Stream.DRAFT)
        token = torch.where(sampling.greedy, z.argmax(dim=-1), drawn)
        one_hot = torch.zeros_like(q).scatter_(1, token.unsqueeze(1), 1.0)
        probs[:, k] = torch.where(greedy, one_hot, q)
        drafts[:, k] = token
        prev = token
    return DraftOutput(drafts, probs)
