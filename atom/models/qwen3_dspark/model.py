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

import torch
from torch import nn

from atom.model_ops.gated_mlp import GATE_UP_SHARDS
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import (
    HeadParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from atom.model_ops.paged_attention import gqa_attention
from atom.model_ops.rotary_embedding import RotaryEmbedding, norm_and_rotate
from atom.models.dspark_base import DraftAttention, DSparkDraft, DSparkLayer
from atom.models.qwen3_dspark.config import Qwen3DSparkConfig

_QKV = re.compile(r"\.self_attn\.(?P<proj>[qkv])_proj\.weight$")
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


class Qwen3DSparkAttention(DraftAttention):
    # Its P/D region name prefix (kv_transfer/regions.py).
    kv_region_kind = "attn"

    def __init__(self, config: Qwen3DSparkConfig, prefix: str) -> None:
        super().__init__(prefix)
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
        self.kv_cache_dim = 2 * self.num_kv_heads * head_dim

    def _qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, h, d], cache rows [k | v] [N, kv_cache_dim]) of x [N, H]."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = norm_and_rotate(q, self.q_norm, self.rotary, positions)
        k = norm_and_rotate(k, self.k_norm, self.rotary, positions)
        return q, torch.cat([k.flatten(1), v.flatten(1)], dim=-1)

    def write_context(
        self, context: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        _, rows = self._qkv(context, positions)
        self.write_rows(slot_mapping, rows)

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
        num_seqs = context_lens.shape[0]
        width = x.shape[0] // num_seqs
        q, block_rows = self._qkv(x, positions)
        block_rows = self.read_back(block_rows).view(num_seqs, width, -1)
        window = None if self.window is None else (self.window, positions)
        keys, visible = self.block_keys(block_rows, block_tables, context_lens, window)
        k, v = keys.split([self.kv_cache_dim // 2] * 2, dim=-1)
        o = gqa_attention(
            q.view(num_seqs, width, self.num_heads, self.head_dim),
            k.unflatten(-1, (self.num_kv_heads, self.head_dim)),
            v.unflatten(-1, (self.num_kv_heads, self.head_dim)),
            visible.unsqueeze(1),
            self.scale,
        )
        o = o.reshape(x.shape[0], self.num_heads * self.head_dim)
        return self.o_proj(o.to(x.dtype))


class Qwen3DSpark(DSparkDraft):
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

    def build(self, config: Qwen3DSparkConfig) -> None:
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = ReplicatedLinear(config.num_taps * config.target_hidden_size, hidden)
        self.hidden_norm = RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            DSparkLayer(config, Qwen3DSparkAttention(config, f"layers.{i}.self_attn"))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, eps=eps)

    def project_context(self, taps_concat: torch.Tensor) -> torch.Tensor:
        """c = hidden_norm(fc(taps))."""
        return self.hidden_norm(self.fc(taps_concat))

    @property
    def output_norm(self) -> nn.Module:
        return self.norm

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
