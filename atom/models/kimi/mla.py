"""Gated NoPE multi-head latent attention over a paged latent cache.

The rope slice of q and k is never rotated but still enters the dot product. A cache
row is [c_kv | k_pe]; heads are split across TP ranks (q_b/q, kv_b, g column-parallel,
o_proj row-parallel), the latent projections and their norms are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.distributed.parallel_state import get_tp_group
from atom.model_ops.attention_backend import (
    LatentLayer,
    MLABackend,
    select_mla_backend,
)
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from atom.model_ops.paged_cache import DEFAULT_KV_SCALE
from atom.model_ops.side_stream import run_beside
from atom.models.kimi.config import KimiTextConfig
from atom.utils.forward_context import require_metadata


class KimiMLAttention(nn.Module):
    # Its P/D region name prefix (kv_transfer/regions.py).
    kv_region_kind = "mla"

    def __init__(
        self, config: KimiTextConfig, prefix: str = "", backend: str = "auto"
    ) -> None:
        super().__init__()
        self.prefix = prefix
        hidden = config.hidden_size
        heads = config.num_attention_heads
        self.heads = heads // get_tp_group().world_size
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        self.scale = qk_dim**-0.5
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.mla_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, config.kv_latent_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.mla_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.nope_dim + self.v_dim)
        )
        self.use_output_gate = config.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = ColumnParallelLinear(hidden, heads * self.v_dim)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden)
        # A `PagedKVLayer` (models/interfaces.py): one latent row per token.
        self.kv_cache_dim = config.kv_latent_dim
        self.kv_cache_dtype: torch.dtype | None = None
        self.kv_scale = DEFAULT_KV_SCALE
        self.kv_cache: torch.Tensor | None = None
        # `Config.attention_backend`; resolved on the first forward (its device).
        self.backend_choice = backend
        self._backend: MLABackend | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        return q.view(x.shape[0], self.heads, self.nope_dim + self.rope_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        metadata = require_metadata(f"MLA layer {self.prefix!r}")
        if self.kv_cache is None:
            raise RuntimeError(
                f"MLA layer {self.prefix!r} has no KV cache; bind one with CacheEngine"
            )
        # The latent row and the output gate read only x: on a side stream
        # (`side_stream.py`) they run under the queries' product and the attention.
        latent = run_beside(lambda: self._latent_row(x), x.device)
        gate = None
        if self.use_output_gate:
            gate = run_beside(lambda: torch.sigmoid(self.g_proj(x).float()), x.device)
        q_nope, q_pe = self._queries(x).split([self.nope_dim, self.rope_dim], dim=-1)
        if self._backend is None:
            self._backend = select_mla_backend(x.device, self.backend_choice)
        layer = LatentLayer(
            self.kv_cache, self.kv_scale, self.kv_b_proj.weight, self.v_dim, self.scale
        )
        o = self._backend.forward(q_nope, q_pe, latent.wait(), layer, metadata)
        o = o.reshape(x.shape[0], self.heads * self.v_dim)
        if gate is not None:
            o = o * gate.wait()
        return self.o_proj(o.to(x.dtype))

    def _latent_row(self, x: torch.Tensor) -> torch.Tensor:
        """The cache row of each token, [c_kv normalised | k_pe]."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        return torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)
