"""Multi-head latent attention over a paged cache of compressed KV rows, batched.

A cache row is [c_kv | k_pe] (kv_lora_rank + rope dims); `kv_b_weight`
[h * (d_nope + d_v), kv_lora] of this rank's h heads turns c_kv into per-head keys
and values. Two exact forms of one attention:

- expanded (prefill): keys and values are re-expanded for every key row, then one
  scaled-dot-product attention per sequence runs over them;
- absorbed (decode, verify): the key up-projection folds into the query and the value
  up-projection into the output, so a step reads each cached latent row once and
  never expands the cache. Scores and softmax accumulate in fp32.

Queries are padded per sequence [B, Q, h, *]; `visible` [B, Q, S] (`visibility.py`)
marks the keys each query row may attend to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Queries per sequence up to which the absorbed form is used: decode and verify rows.
ABSORB_MAX_QUERY_LEN = 16


def split_kv_b(
    kv_b_weight: torch.Tensor, heads: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_uk [h, d_nope, c], W_uv [h, d_v, c]) as views of kv_b_weight."""
    per_head = kv_b_weight.view(heads, -1, kv_b_weight.shape[-1])
    d_nope = per_head.shape[1] - v_dim
    return per_head[:, :d_nope], per_head[:, d_nope:]


def absorbed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    keys: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_dim: int,
    scale: float,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Latent-space attention: [B, Q, h, d_v] fp32 from keys [B, S, c + r]."""
    heads = q_nope.shape[2]
    rank = kv_b_weight.shape[-1]
    w_uk, w_uv = split_kv_b(kv_b_weight, heads, v_dim)
    c_kv, k_pe = keys[..., :rank], keys[..., rank:]
    q_latent = torch.einsum("bqhd,hdc->bqhc", q_nope, w_uk.to(q_nope.dtype))
    scores = torch.einsum("bqhc,bsc->bhqs", q_latent, c_kv.to(q_latent.dtype)).float()
    scores += torch.einsum("bqhr,bsr->bhqs", q_pe, k_pe.to(q_pe.dtype)).float()
    scores = (scores * scale).masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o_latent = torch.einsum("bhqs,bsc->bqhc", probs, c_kv.float())
    return torch.einsum("bqhc,hvc->bqhv", o_latent, w_uv.float())


def expanded_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    keys: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_dim: int,
    scale: float,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Attention over re-expanded keys and values: [B, Q, h, d_v] fp32."""
    heads, d_nope = q_nope.shape[2], q_nope.shape[3]
    rank = kv_b_weight.shape[-1]
    c_kv, k_pe = keys[..., :rank], keys[..., rank:]
    kv = (c_kv.float() @ kv_b_weight.float().t()).unflatten(-1, (heads, -1))
    k_nope, v = kv.split([d_nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.float().unsqueeze(2).expand(-1, -1, heads, -1)], -1)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible.unsqueeze(1),
        scale=scale,
    )
    return o.transpose(1, 2)


def latent_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    keys: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_dim: int,
    scale: float,
    visible: torch.Tensor,
) -> torch.Tensor:
    """The absorbed form for few queries per sequence, the expanded one otherwise.

    Key rows no query may see are zeroed first: a gather of whole blocks reads rows
    past a sequence's end, and whatever they hold must not reach the output (a
    masked score still multiplies its value row by zero, and 0 * nan is nan).
    """
    keys = torch.where(visible.any(dim=1).unsqueeze(-1), keys, 0)
    if q_nope.shape[1] <= ABSORB_MAX_QUERY_LEN:
        return absorbed_attention(
            q_nope, q_pe, keys, kv_b_weight, v_dim, scale, visible
        )
    return expanded_attention(q_nope, q_pe, keys, kv_b_weight, v_dim, scale, visible)
