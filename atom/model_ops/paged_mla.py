"""Multi-head latent attention over a paged cache of compressed KV rows.

A cache row is [c_kv | k_pe] (kv_lora_rank + rope dims). Keys and values are
re-expanded from the latent per head with this rank's slice of kv_b_proj.
"""

from __future__ import annotations

import torch


def write_kv(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor
) -> None:
    """Store `rows` [N, D] at flat slots (block * block_size + offset); -1 skips a row."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = rows[keep].to(kv_cache.dtype)


def read_kv(
    kv_cache: torch.Tensor, block_table: list[int], length: int
) -> torch.Tensor:
    """The first `length` cached rows of one sequence, in position order."""
    block_size = kv_cache.shape[1]
    needed = (length + block_size - 1) // block_size
    if needed > len(block_table):
        raise RuntimeError(
            f"block table of {len(block_table)} blocks cannot hold {length} rows"
        )
    blocks = torch.as_tensor(block_table[:needed], device=kv_cache.device)
    return kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:length]


def causal_mask(query_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[Tq, Tk] bool: a query at position q sees keys 0..q."""
    keys = torch.arange(num_keys, device=query_positions.device)
    return keys.unsqueeze(0) <= query_positions.unsqueeze(1)


def latent_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of [Tq, h, *] queries over [Tk] latent rows; returns [Tq, h, dv] fp32.

    `kv_b_weight` is [h * (d_nope + d_v), kv_lora] for this rank's h heads; k_pe is
    shared by all heads. `mask` [Tq, Tk] (True = attend) or None for full attention.
    """
    heads, d_nope = q_nope.shape[1], q_nope.shape[2]
    kv = (c_kv.float() @ kv_b_weight.float().t()).view(-1, heads, d_nope + v_head_dim)
    k_nope, v = kv.split([d_nope, v_head_dim], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q_nope.float(), k_nope)
    scores = scores + torch.einsum("qhd,kd->hqk", q_pe.float(), k_pe.float())
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
