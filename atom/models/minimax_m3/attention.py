"""MiniMax-M3 attention: GQA with per-head Gemma QK-norm and partial RoPE, and on
sparse layers the lightning indexer choosing key blocks (block-sparse attention).

One head-parallel projection yields q, k, v (and on sparse layers the index query
and the single index key) for this rank's heads. KV heads, and the index heads that
go with them (index head g selects for KV group g), are split across TP ranks or,
when there are fewer of them than ranks, replicated. A cache row is
[k | v | index key], so the index keys live in the same pages as the KV rows.
Writing them and attending run in the layer's `GQABackend`
(`model_ops/attention_backend.py`, chosen by `Config.attention_backend`).
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.attention_backend import (
    GQABackend,
    GQALayer,
    select_gqa_backend,
)
from atom.model_ops.layernorm import GemmaRMSNorm
from atom.model_ops.linear import HeadParallelLinear, RowParallelLinear
from atom.model_ops.paged_cache import DEFAULT_KV_SCALE
from atom.model_ops.rotary_embedding import RotaryEmbedding, norm_and_rotate
from atom.models.minimax_m3.config import MiniMaxM3TextConfig
from atom.utils.forward_context import require_metadata

# Checkpoint projection -> shard of the fused `qkv_proj`.
QKV_SHARDS = {
    "q_proj": 0,
    "k_proj": 1,
    "v_proj": 2,
    "index_q_proj": 3,
    "index_k_proj": 4,
}


class MiniMaxM3Attention(nn.Module):
    # Its P/D region name prefix (kv_transfer/regions.py).
    kv_region_kind = "attn"

    def __init__(
        self,
        config: MiniMaxM3TextConfig,
        layer_idx: int,
        prefix: str = "",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.sparse = config.layers[layer_idx].sparse_attention
        hidden, head_dim = config.hidden_size, config.head_dim
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        parts = [(heads, head_dim), (kv_heads, head_dim), (kv_heads, head_dim)]
        self.indexer = config.indexer if self.sparse else None
        if self.indexer is not None:
            index_dim = self.indexer.head_dim
            parts += [(self.indexer.num_heads, index_dim), (1, index_dim)]
        self.qkv_proj = HeadParallelLinear(hidden, parts)
        local = [len(r) for r in self.qkv_proj.local_heads]
        self.num_heads, self.num_kv_heads = local[0], local[1]
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        eps = config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(head_dim, eps=eps)
        self.k_norm = GemmaRMSNorm(head_dim, eps=eps)
        if self.indexer is not None:
            self.index_q_norm = GemmaRMSNorm(self.indexer.head_dim, eps=eps)
            self.index_k_norm = GemmaRMSNorm(self.indexer.head_dim, eps=eps)
        # NeoX RoPE on each head's first rotary_dim channels; the rest pass.
        self.rotary = RotaryEmbedding(
            config.rotary_dim, config.rope_theta, interleaved=False
        )
        # Rows follow q's heads, which the config guarantees split evenly over TP.
        self.o_proj = RowParallelLinear(heads * head_dim, hidden)
        # A `PagedKVLayer` (models/interfaces.py): rows [k | v | index key].
        self.kv_width = self.num_kv_heads * head_dim
        index_width = self.indexer.head_dim if self.indexer is not None else 0
        self.kv_cache_dim = 2 * self.kv_width + index_width
        self.kv_cache_dtype: torch.dtype | None = None
        self.kv_scale = DEFAULT_KV_SCALE
        self.kv_cache: torch.Tensor | None = None
        # `Config.attention_backend`; resolved on the first forward (its device).
        self.backend_choice = backend
        self._backend: GQABackend | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def _cache_rows(
        self, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, h, d], cache rows [N, kv_cache_dim], index queries [N, g, di])."""
        q, k, v, *index = self.qkv_proj.split(self.qkv_proj(x))
        q = norm_and_rotate(q, self.q_norm, self.rotary, positions)
        k = norm_and_rotate(k, self.k_norm, self.rotary, positions)
        row = [k.flatten(1), v.flatten(1)]
        index_q = None
        if self.indexer is not None:
            index_q = norm_and_rotate(
                index[0], self.index_q_norm, self.rotary, positions
            )
            index_k = norm_and_rotate(
                index[1], self.index_k_norm, self.rotary, positions
            )
            row.append(index_k.flatten(1))
        return q, torch.cat(row, dim=-1), index_q

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        metadata = require_metadata(f"attention layer {self.prefix!r}")
        if self.kv_cache is None:
            raise RuntimeError(
                f"attention layer {self.prefix!r} has no KV cache; bind one with "
                "CacheEngine"
            )
        q, rows, index_q = self._cache_rows(positions, x)
        if self._backend is None:
            self._backend = select_gqa_backend(x.device, self.backend_choice)
        layer = GQALayer(
            self.kv_cache,
            self.kv_scale,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            self.indexer,
        )
        o = self._backend.forward(q, rows, index_q, layer, metadata)
        o = o.reshape(x.shape[0], self.num_heads * self.head_dim)
        return self.o_proj(o.to(x.dtype))
