"""Token sampling: temperature, top-k, top-p, and draws from counter-based uniforms.

`filtered_probs` is the single definition of a request's filtered distribution;
the verifier and the draft's Markov head use it too, so a draft's q and the
target's p are always filtered the same way. `probs_for` is its checked form for
callers off the hot path.

Draws are exponential races: token argmax_i w_i / E_i with E_i = -log(u_i) i.i.d.
Exp(1) is distributed as w / sum(w) for any non-negative weights w, so residuals
need no normalising, and a row's draw depends only on its own weights and
uniforms, never on the batch around it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atom.model_ops.counter_random import Stream, uniforms
from atom.model_ops.sampling_metadata import SamplingMetadata, per_row

Scalars = float | int | Sequence[float] | Sequence[int] | torch.Tensor


def _filter_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uses_top_k: bool,
    uses_top_p: bool,
) -> torch.Tensor:
    """Set filtered-out logits to -inf.

    top-k keeps every logit >= the k-th largest (ties at the k-th value are kept);
    top-p then keeps the smallest head of the descending order (lower token id
    first on ties) whose renormalised mass reaches p. The flags say whether any
    row uses each filter, so an unfiltered batch skips the sort.
    """
    if not uses_top_k and not uses_top_p:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if uses_top_k:
        use_k = (top_k > 0) & (top_k < vocab)
        kth_index = (torch.where(use_k, top_k, vocab) - 1).unsqueeze(1)
        kth = sorted_logits.gather(1, kth_index)
        drop |= (sorted_logits < kth) & use_k.unsqueeze(1)
    if uses_top_p:
        use_p = top_p < 1
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= (mass_before >= top_p.unsqueeze(1)) & use_p.unsqueeze(1)
    drop = torch.zeros_like(drop).scatter(1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def filtered_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    uses_top_k: bool = True,
    uses_top_p: bool = True,
) -> torch.Tensor:
    """[N, V] fp32 softmax of logits / temperature after top-k and top-p.

    Per-row settings are [N] tensors on the logits' device. Temperature-0 rows are
    scaled by 1 (their caller takes the argmax instead). Never synchronises.
    """
    temps = temperatures.float()
    scaled = logits.float() / torch.where(temps == 0, 1.0, temps).unsqueeze(1)
    scaled = _filter_top_k_top_p(scaled, top_ks, top_ps, uses_top_k, uses_top_p)
    return scaled.softmax(dim=-1)


def probs_for(
    logits: torch.Tensor,
    temperature: Scalars,
    top_k: Scalars = -1,
    top_p: Scalars = 1.0,
) -> torch.Tensor:
    """[B, V] fp32 distribution each row is sampled from (checked, synchronising).

    Arguments are one value for all rows or one per row. Temperature 0 rows get
    the one-hot of their argmax (lowest index on ties).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    rows, device = logits.shape[0], logits.device

    def settings(values: Scalars, dtype: torch.dtype, name: str) -> torch.Tensor:
        return torch.tensor(per_row(values, rows, name), dtype=dtype, device=device)

    temps = settings(temperature, torch.float32, "temperature")
    ks = settings(top_k, torch.long, "top_k")
    ps = settings(top_p, torch.float32, "top_p")
    if bool((temps < 0).any()):
        raise ValueError("temperature must be >= 0")
    probs = filtered_probs(logits, temps, ks, ps)
    greedy = temps == 0
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(
            1, logits.argmax(-1, keepdim=True), 1
        )
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def exponential_race(weights: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """[N] argmax_i w_i / -log(u_i) per row: a draw from w / sum(w).

    Zero weights never win; ties go to the lowest index. u must lie in (0, 1).
    """
    keys = weights / -torch.log(unit)
    return torch.where(weights > 0, keys, -1.0).argmax(dim=-1)


def draw_tokens(
    weights: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    streams: torch.Tensor | int,
) -> torch.Tensor:
    """[N] one draw per row of non-negative weights [N, V] (not necessarily
    normalised), from the uniforms of (seed, position, stream) of that row."""
    unit = uniforms(seeds, positions, streams, weights.shape[-1])
    return exponential_race(weights.float(), unit)


def sample_tokens(logits: torch.Tensor, sampling: SamplingMetadata) -> torch.Tensor:
    """[S] the next token of each row of logits [S, V]: the argmax (lowest index on
    ties) for greedy rows, else a draw from `filtered_probs` on the TARGET stream
    at the row's position. A seeded row gets the same token whatever its batch."""
    if logits.dim() != 2 or logits.shape[0] != sampling.num_seqs:
        raise ValueError(
            f"logits must be [{sampling.num_seqs}, V], got {tuple(logits.shape)}"
        )
    greedy_tokens = logits.argmax(dim=-1)
    if sampling.all_greedy:
        return greedy_tokens
    probs = filtered_probs(
        logits,
        sampling.temperatures,
        sampling.top_ks,
        sampling.top_ps,
        sampling.uses_top_k,
        sampling.uses_top_p,
    )
    drawn = draw_tokens(probs, sampling.seeds, sampling.positions, Stream.TARGET)
    return torch.where(sampling.greedy, greedy_tokens, drawn)
