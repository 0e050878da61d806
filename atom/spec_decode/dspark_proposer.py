"""DSpark's sequential Markov head over the block's base logits (dspark.md 3.7).

For k = 1..T: z_k = U_k + W1[x_{k-1}] W2^T in fp32; greedy requests take
argmax z_k (lowest index on ties), sampled ones draw x_k from q_k = probs_for(z_k)
with their own generator and keep q_k for lossless verification. Only this loop is
sequential; the backbone ran once for all T rows.

TP: every rank holds the same logits and identically seeded per-request generators
and consumes them in the same order, so drafts agree on all ranks without a
broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from atom.model_ops.sampler import probs_for


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row of probs [S, V] with u [S] in [0, 1).

    Never returns a zero-probability token: rounding that pushes u * mass past the
    last positive entry lands on that entry.
    """
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(probs.device) * cdf[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    vocab = probs.shape[-1]
    last_positive = vocab - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(index, last_positive)


def _uniform(generator: torch.Generator | None) -> torch.Tensor:
    device = generator.device if generator is not None else "cpu"
    return torch.rand((), generator=generator, device=device).cpu()


def markov_decode(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    markov_bias: Callable[[torch.Tensor], torch.Tensor],
    temperatures: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(drafts [B, T] long, q [B, T, V] fp32 or None when every request is greedy).

    Greedy requests in a mixed batch get q = one-hot(draft), the exact law of a
    greedy draft.
    """
    num_seqs, width, _ = base_logits.shape
    for name, values in (
        ("temperatures", temperatures),
        ("top_ks", top_ks),
        ("top_ps", top_ps),
        ("generators", generators),
    ):
        if len(values) != num_seqs:
            raise ValueError(f"{len(values)} {name} for {num_seqs} sequences")
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    device = base_logits.device
    drafts = torch.empty(num_seqs, width, dtype=torch.long, device=device)
    probs = torch.empty_like(base_logits, dtype=torch.float32) if sampled else None
    sampled_rows = torch.tensor(sampled, dtype=torch.long, device=device)
    prev = anchor_ids
    for k in range(width):
        z = base_logits[:, k].float() + markov_bias(prev)
        token = z.argmax(dim=-1)
        if sampled:
            q = probs_for(z, list(temperatures), list(top_ks), list(top_ps))
            probs[:, k] = q
            uniforms = torch.stack([_uniform(generators[i]) for i in sampled])
            token[sampled_rows] = draw_from(q[sampled_rows], uniforms)
        drafts[:, k] = token
        prev = token
    return drafts, probs
