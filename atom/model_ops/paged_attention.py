"""Grouped-query attention over a paged cache of full key / value rows, batched.

A cache row holds one token's keys and values for this rank's KV heads (a layer may
append more, e.g. an index key); `paged_cache.write_kv` / `gather_kv` store and read
rows of any width. Queries are padded per sequence [B, Q, hq, d]; `visible`
[B, g, Q, S] (`visibility.py`) marks the keys each query row may attend to, g = 1 (all heads alike)
or g = hkv (one mask per KV group, as block-sparse attention selects).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per query head over its KV group: [B, Q, hq, dv].

    q [B, Q, hq, d]; k [B, S, hkv, d]; v [B, S, hkv, dv]; visible [B, g, Q, S].
    Key rows no query sees are zeroed first (0 * nan would still be nan).
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    if visible.shape[1] not in (1, kv_heads):
        raise ValueError(
            f"visible has {visible.shape[1]} masks; expected 1 or one per KV head "
            f"({kv_heads})"
        )
    seen = visible.any(dim=2).any(dim=1).view(*k.shape[:2], 1, 1)
    k = torch.where(seen, k, 0).to(q.dtype)
    v = torch.where(seen, v, 0).to(q.dtype)
    if visible.shape[1] > 1:
        visible = visible.repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)
