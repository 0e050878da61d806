"""The Qwen3-style DSpark draft (Qwen3DSparkModel): MiniMax-M3's drafter.

A DFlash-style Qwen3 stack that drafts T tokens in one non-causal pass, plus the
Markov head. Target context enters only as *context rows* in each draft layer's
paged KV cache: `write_context_kv` projects the taps once per target forward,
c = hidden_norm(fc(taps)), and writes [k | v] rows at the target rows' slots, with
k = RoPE(k_norm(c W_k)) and v = c W_v (no input_layernorm). `block_forward` runs the
rows [x0, m, ..., m] at positions p+1..p+T, embedded with the target's table: a
block row at position a sees context rows a - window + 1 .. p and every block row
(non-causal), and row 0's output is draft 1. Logits come from the target's head.

Qwen3 numerics, not the target's: plain RMSNorm, per-head q/k RMSNorm before a NeoX
RoPE over the whole head with the draft's own theta, SiLU-gated MLP.

Tensor parallelism: heads are split (KV heads replicated past their count), the MLP
is column/row split, and `fc` and the Markov tables are replicated, so every TP rank
writes the context rows of its own KV heads from identical inputs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from atom.model_ops.activation import SiluAndMul
from atom.model_ops.gated_mlp import GATE_UP_SHARDS, GatedMLP
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import (
    HeadParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from atom.model_ops.paged_attention import gqa_attention
from atom.model_ops.paged_mla import gather_kv, write_kv
from atom.model_ops.rotary_embedding import RotaryEmbedding
from atom.models.dspark_base import MarkovHead, SharedEmbeddingDraft
from atom.models.minimax_m3.dspark_config import Qwen3DSparkConfig
from atom.utils.forward_context import ForwardContext, set_forward_context

_QKV = re.compile(r"\.self_attn\.(?P<proj>[qkv])_proj\.weight$")
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


class Qwen3DSparkAttention(nn.Module):
    def __init__(self, config: Qwen3DSparkConfig, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        head_dim = config.head_dim
        self.qkv_proj = HeadParallelLinear(
            config.hidden_size,
            [
                (config.num_attention_heads, head_dim),
                (config.num_key_value_heads, head_dim),
                (config.num_key_value_heads, head_dim),
            ],
        )
        self.num_heads = len(self.qkv_proj.local_heads[0])
        self.num_kv_heads = len(self.qkv_proj.local_heads[1])
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size
        )
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.rotary = RotaryEmbedding(head_dim, config.rope_theta, interleaved=False)
        self.scale = head_dim**-0.5
        self.window = config.window
        # The CacheEngine binds `kv_cache` [num_blocks, block_size, kv_cache_dim].
        self.kv_cache_dim = 2 * self.num_kv_heads * head_dim
        self.kv_cache: torch.Tensor | None = None

    def _cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(
                f"draft attention {self.prefix!r} has no KV cache; bind one with "
                "CacheEngine before writing or reading context rows"
            )
        return self.kv_cache

    def _qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, h, d], cache rows [k | v] [N, kv_cache_dim]) of x [N, H]."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = self.rotary(positions, self.q_norm(q))
        k = self.rotary(positions, self.k_norm(k))
        return q, torch.cat([k.flatten(1), v.flatten(1)], dim=-1)

    def write_context(
        self, context: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        _, rows = self._qkv(context, positions)
        write_kv(self._cache(), slot_mapping, rows)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """x: [B*T, H] block rows; sequence b's context rows are 0..context_lens[b]-1.

        Block KV stays transient: it is attended to, never written.
        """
        cache = self._cache()
        num_seqs = context_lens.shape[0]
        width = x.shape[0] // num_seqs
        q, block_rows = self._qkv(x, positions)
        # Rounded through the cache dtype, as if written to the cache and read back.
        block_rows = block_rows.to(cache.dtype).view(num_seqs, width, -1)
        context = gather_kv(cache, block_tables)
        keys = torch.cat([context, block_rows], dim=1)
        context_index = torch.arange(context.shape[1], device=x.device)
        seen = context_index < context_lens.view(-1, 1, 1)
        if self.window is not None:
            first = positions.view(num_seqs, width, 1) - (self.window - 1)
            seen = seen & (context_index >= first)
        block = seen.new_ones(num_seqs, width, width)
        visible = torch.cat([seen.expand(-1, width, -1), block], dim=-1).unsqueeze(1)
        k, v = keys.split([self.kv_cache_dim // 2] * 2, dim=-1)
        o = gqa_attention(
            q.view(num_seqs, width, self.num_heads, self.head_dim),
            k.unflatten(-1, (self.num_kv_heads, self.head_dim)),
            v.unflatten(-1, (self.num_kv_heads, self.head_dim)),
            visible,
            self.scale,
        )
        o = o.reshape(x.shape[0], self.num_heads * self.head_dim)
        return self.o_proj(o.to(x.dtype))


class Qwen3DSparkLayer(nn.Module):
    def __init__(self, config: Qwen3DSparkConfig, prefix: str) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.self_attn = Qwen3DSparkAttention(config, f"{prefix}.self_attn")
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


class Qwen3DSpark(SharedEmbeddingDraft):
    """Qwen3DSparkModel: fc over the taps, hidden norm, non-causal sliding-window
    layers, final norm, Markov head.

    `embed_tokens` and `lm_head` are the target's, bound by `share_with_target`
    after loading; a shipped embedding copy and the confidence head are skipped.
    """

    # One plain class-level list, never rebound or mutated per stage.
    skip_weight_prefixes = [
        "confidence_head.",
        "embed_tokens.",
        "lm_head.",
        "mask_embedding",
        "t2d",
    ]
    config_class = Qwen3DSparkConfig

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
        self.fc = ReplicatedLinear(config.num_taps * config.target_hidden_size, hidden)
        self.hidden_norm = RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            Qwen3DSparkLayer(config, f"layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, eps=eps)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """DFlash / DSpark Qwen3 names, with or without a `model.` prefix."""
        name = name.removeprefix("model.")
        if any(name.startswith(prefix) for prefix in self.skip_weight_prefixes):
            return None
        if name == "d2t":
            raise ValueError(
                "the draft checkpoint ships d2t: reduced-vocabulary drafts are not "
                "supported (the draft scores the target's full vocabulary)"
            )
        qkv = _QKV.search(name)
        if qkv:
            fused = name[: qkv.start()] + ".self_attn.qkv_proj.weight"
            return fused, _QKV_SHARDS[qkv["proj"]]
        for part, shard in GATE_UP_SHARDS:
            if f".{part}." in name:
                return name.replace(f".{part}.", ".gate_up_proj."), shard
        return name, None

    def write_context_kv(
        self,
        taps_concat: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write every draft layer's context rows for one target forward.

        taps_concat [N, n_taps * H] in tap order.
        """
        expected = self.config.num_taps * self.config.target_hidden_size
        if taps_concat.dim() != 2 or taps_concat.shape[1] != expected:
            raise ValueError(
                f"taps_concat must be [N, {expected}], got {tuple(taps_concat.shape)}"
            )
        context = self.hidden_norm(self.fc(taps_concat))
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
        if self.embed_tokens is None or self.lm_head is None:
            raise RuntimeError(
                "the draft has no embedding / LM head: call share_with_target first "
                "(a context-only producer never proposes)"
            )
        num_seqs = anchor_ids.shape[0]
        block_ids = anchor_ids.new_full((num_seqs, num_rows), self.mask_token_id)
        block_ids[:, 0] = anchor_ids
        offsets = torch.arange(num_rows, device=anchor_ids.device)
        positions = (anchor_positions.unsqueeze(1) + offsets).reshape(-1)
        # is_draft: tap hooks on the shared embedding must not record the block.
        with set_forward_context(ForwardContext(is_draft=True)):
            h = self.embed_tokens(block_ids.reshape(-1))
            for layer in self.layers:
                h = layer(h, positions, block_tables, anchor_positions)
            logits = self.lm_head.compute_logits(self.norm(h))
        return logits.float().view(num_seqs, num_rows, -1)

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_head.bias(prev_ids)
