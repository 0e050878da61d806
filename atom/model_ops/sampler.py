"""Token sampling: temperature, top-k, top-p and per-request generators.

`probs_for` is the single definition of a request's filtered distribution; the
rejection sampler and the draft's Markov sampler use it too, so a draft's q and
the target's p are always filtered the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Scalars = float | int | Sequence[float] | Sequence[int] | torch.Tensor


def _per_row(
    value: Scalars, num_rows: int, dtype: torch.dtype, device: torch.device, name: str
) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        values = value.to(device=device, dtype=dtype).reshape(-1)
    elif isinstance(value, (int, float)):
        values = torch.full((num_rows,), value, dtype=dtype, device=device)
    else:
        values = torch.tensor(list(value), dtype=dtype, device=device)
    if values.numel() != num_rows:
        raise ValueError(f"{name}: {values.numel()} values for {num_rows} rows")
    return values


def _filter_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set filtered-out logits to -inf.

    top-k keeps every logit >= the k-th largest (ties at the k-th value are kept);
    top-p then keeps the smallest head of the descending order (lower token id
    first on ties) whose renormalised mass reaches p.
    """
    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1
    if not bool(use_k.any()) and not bool(use_p.any()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if bool(use_k.any()):
        kth_index = (torch.where(use_k, top_k, vocab) - 1).unsqueeze(1)
        kth = sorted_logits.gather(1, kth_index)
        drop |= (sorted_logits < kth) & use_k.unsqueeze(1)
    if bool(use_p.any()):
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= (mass_before >= top_p.unsqueeze(1)) & use_p.unsqueeze(1)
    drop = torch.zeros_like(drop).scatter(1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def probs_for(
    logits: torch.Tensor,
    temperature: Scalars,
    top_k: Scalars = -1,
    top_p: Scalars = 1.0,
) -> torch.Tensor:
    """[B, V] fp32 distribution each row is sampled from.

    Arguments are one value for all rows or one per row. Temperature 0 rows get
    the one-hot of their argmax (lowest index on ties).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    rows, device = logits.shape[0], logits.device
    logits = logits.float()
    temps = _per_row(temperature, rows, torch.float32, device, "temperature")
    ks = _per_row(top_k, rows, torch.long, device, "top_k")
    ps = _per_row(top_p, rows, torch.float32, device, "top_p")
    if bool((temps < 0).any()):
        raise ValueError("temperature must be >= 0")
    greedy = temps == 0
    scaled = logits / torch.where(greedy, 1.0, temps).unsqueeze(1)
    probs = _filter_top_k_top_p(scaled, ks, ps).softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(
            1, logits.argmax(-1, keepdim=True), 1
        )
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        temperatures: Scalars,
        top_ks: Scalars,
        top_ps: Scalars,
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """[B] token ids. Greedy rows take the argmax (lowest index on ties);
        others draw from `probs_for` with their own generator (on the logits'
        device), so a seeded request is reproducible whatever its batch."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        rows, device = logits.shape[0], logits.device
        if len(generators) != rows:
            raise ValueError(f"{len(generators)} generators for {rows} rows")
        temps = _per_row(temperatures, rows, torch.float32, device, "temperatures")
        ks = _per_row(top_ks, rows, torch.long, device, "top_ks")
        ps = _per_row(top_ps, rows, torch.float32, device, "top_ps")
        tokens = logits.argmax(dim=-1)
        sampled = (temps > 0).nonzero().flatten()
        if sampled.numel() == 0:
            return tokens
        probs = probs_for(logits[sampled], temps[sampled], ks[sampled], ps[sampled])
        unseeded = []
        for i, row in enumerate(sampled.tolist()):
            generator = generators[row]
            if generator is None:
                unseeded.append(i)
            else:
                tokens[row] = torch.multinomial(probs[i], 1, generator=generator)[0]
        if unseeded:
            draws = torch.multinomial(probs[unseeded], 1).flatten()
            tokens[sampled[unseeded]] = draws
        return tokens

    probs_for = staticmethod(probs_for)
