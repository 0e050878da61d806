"""The Kimi-K3 DSpark draft (K3DSparkModel; docs/dspark.md).

A small MLA + SwiGLU stack that drafts T tokens in one non-causal pass. Target
context enters only as *context rows* in each draft layer's paged KV cache:
`write_context_kv` projects the target's tap hidden states once per target forward
and writes [c_kv | k_pe] rows at the target rows' slots. `block_forward` runs the
rows [x0, m, ..., m] against those rows and returns full-vocabulary base logits; the
Markov head adds a first-order transition bias (the proposer loops over it).

Tensor parallelism: heads are split (q_b/kv_b column, o_proj row), the MLP is
column/row split, and `context_proj`, the latent projections and the Markov tables
are replicated, so every TP rank writes identical context rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from atom.distributed.parallel_state import get_tp_group
from atom.model_ops.activation import SiluAndMul
from atom.model_ops.gated_mlp import GatedMLP
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from atom.model_ops.paged_mla import gather_kv, latent_attention, write_kv
from atom.model_ops.rotary_embedding import RotaryEmbedding
from atom.models.dspark_base import MarkovHead, SharedEmbeddingDraft
from atom.models.kimi_k3.dspark_config import DSparkDraftConfig
from atom.utils.forward_context import ForwardContext, set_forward_context


class DSparkAttention(nn.Module):
    """RoPE MLA without output gate; its KV rows share the target's paged pool."""

    def __init__(self, config: DSparkDraftConfig, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.heads = divide(heads, get_tp_group().world_size, "num_attention_heads")
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk_dim)
        self.q_b_proj.weight.weight_loader = self._load_q_b
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, config.kv_latent_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.nope_dim + self.v_dim)
        )
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden)
        # The draft's own YaRN RoPE, GPT-J interleaved.
        self.rotary = RotaryEmbedding(
            self.rope_dim, config.rope_theta, config.rope_scaling, interleaved=True
        )
        self.scale = qk_dim**-0.5 * self.rotary.attention_scale
        # The CacheEngine binds `kv_cache` [num_blocks, block_size, kv_cache_dim].
        self.kv_cache_dim = config.kv_latent_dim
        self.kv_cache: torch.Tensor | None = None

    def _load_q_b(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = self.heads * get_tp_group().world_size * (self.nope_dim + self.rope_dim)
        if loaded.shape[0] != rows:
            raise ValueError(
                f"q_b_proj has {loaded.shape[0]} rows, but num_attention_heads x "
                f"(qk_nope_head_dim + qk_rope_head_dim) = {rows}"
            )
        self.q_b_proj.weight_loader(param, loaded)

    def _cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(
                f"draft attention {self.prefix!r} has no KV cache; bind one with "
                "CacheEngine before writing or reading context rows"
            )
        return self.kv_cache

    def latent_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[c_kv | RoPE(k_pe)] of every row of x [N, H] (the cache row layout)."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        return torch.cat(
            [self.kv_a_layernorm(c_kv), self.rotary(positions, k_pe)], dim=-1
        )

    def write_context(
        self, context: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        write_kv(self._cache(), slot_mapping, self.latent_rows(context, positions))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """x: [B*T, H] block rows; each block sees its context rows and itself.

        Sequence b attends to its cached rows 0..context_lens[b]-1 plus all T block
        rows, without a causal mask inside the block. Block KV stays transient.
        """
        cache = self._cache()
        num_seqs = context_lens.shape[0]
        width = x.shape[0] // num_seqs
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_seqs, width, self.heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = self.rotary(positions, q_pe.reshape(x.shape[0], self.heads, -1))
        # Rounded through the cache dtype, as if written to the cache and read back.
        block_rows = self.latent_rows(x, positions).to(cache.dtype)
        context = gather_kv(cache, block_tables)
        keys = torch.cat([context, block_rows.view(num_seqs, width, -1)], dim=1)
        key_index = torch.arange(keys.shape[1], device=x.device)
        visible = (key_index < context_lens.unsqueeze(1)) | (
            key_index >= context.shape[1]
        )
        o = latent_attention(
            q_nope,
            q_pe.view(num_seqs, width, self.heads, -1),
            keys.to(x.dtype),
            self.kv_b_proj.weight,
            self.v_dim,
            self.scale,
            visible.unsqueeze(1).expand(-1, width, -1),
        )
        o = o.reshape(x.shape[0], self.heads * self.v_dim)
        return self.o_proj(o.to(x.dtype))


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config: DSparkDraftConfig, prefix: str) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.self_attn = DSparkAttention(config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, SiluAndMul())

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        h = h + self.self_attn(
            self.input_layernorm(h), positions, block_tables, context_lens
        )
        return h + self.mlp(self.post_attention_layernorm(h))


class KimiK3DSpark(SharedEmbeddingDraft):
    """K3DSparkModel: context projection, MLA + SwiGLU layers, final norm, Markov head.

    `embed_tokens` and `lm_head` are the target's, bound by `share_with_target`
    after loading; the checkpoint's embedding copy and confidence head are skipped.
    """

    # One plain class-level list, never rebound or mutated per stage.
    skip_weight_prefixes = ["confidence_head.", "embed_tokens.", "lm_head."]
    config_class = DSparkDraftConfig
    packed_modules_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        draft_config: Mapping[str, Any],
        target_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        config = self.config_class.from_hf(draft_config)
        if target_config is not None:
            config.validate_against_target(target_config)
        self.config = config
        self.vocab_size = config.vocab_size
        self.tap_ids = list(config.target_layer_ids)
        self.mask_token_id = config.mask_token_id
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.context_proj = ReplicatedLinear(
            config.num_taps * config.target_hidden_size, hidden
        )
        self.context_norm = RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            DSparkDecoderLayer(config, f"layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.final_norm = RMSNorm(hidden, eps=eps)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)

    def write_context_kv(
        self,
        taps_concat: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write every draft layer's context rows for one target forward.

        taps_concat [N, n_taps * H_target] in tap order. c = RMSNorm(context_proj(a))
        goes straight into each layer's KV half, without its input_layernorm.
        """
        expected = self.config.num_taps * self.config.target_hidden_size
        if taps_concat.dim() != 2 or taps_concat.shape[1] != expected:
            raise ValueError(
                f"taps_concat must be [N, {expected}], got {tuple(taps_concat.shape)}"
            )
        context = self.context_norm(self.context_proj(taps_concat))
        for layer in self.layers:
            layer.self_attn.write_context(context, positions, slot_mapping)

    def block_forward(
        self,
        anchor_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        block_tables: torch.Tensor,
        num_rows: int,
    ) -> torch.Tensor:
        """Base logits U [B, T, V] fp32 of the block [x0, m, ..., m].

        anchor_positions[b] is the anchor's own position p+1 (p = the row whose
        logits produced it); block rows sit at p+1..p+T and see context rows 0..p.
        """
        block_ids = anchor_ids.new_full(
            (anchor_ids.shape[0], num_rows), self.mask_token_id
        )
        block_ids[:, 0] = anchor_ids
        return self.forward_block_rows(block_ids, anchor_positions, block_tables)

    def forward_block_rows(
        self,
        block_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [B, T, V] fp32 for explicit block inputs [B, T] (row 0 = anchor).

        block_tables [B, W] must cover each sequence's context rows."""
        if self.embed_tokens is None or self.lm_head is None:
            raise RuntimeError(
                "the draft has no embedding / LM head: call share_with_target first "
                "(a context-only producer never proposes)"
            )
        num_seqs, width = block_ids.shape
        offsets = torch.arange(width, device=block_ids.device)
        positions = (anchor_positions.unsqueeze(1) + offsets).reshape(-1)
        context_lens = anchor_positions
        # is_draft: tap hooks on the shared embedding must not record the block.
        with set_forward_context(ForwardContext(is_draft=True)):
            h = self.embed_tokens(block_ids.reshape(-1))
            for layer in self.layers:
                h = layer(h, positions, block_tables, context_lens)
            logits = self.lm_head.compute_logits(self.final_norm(h))
        return logits.float().view(num_seqs, width, -1)

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_head.bias(prev_ids)
