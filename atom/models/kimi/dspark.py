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

import torch
from torch import nn

from atom.distributed.parallel_state import get_tp_group
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from atom.model_ops.paged_mla import latent_attention
from atom.model_ops.rotary_embedding import RotaryEmbedding
from atom.model_ops.side_stream import run_beside
from atom.models.dspark_base import DraftAttention, DSparkDraft, DSparkLayer
from atom.models.kimi.dspark_config import DSparkDraftConfig


class DSparkAttention(DraftAttention):
    """RoPE MLA without output gate; its KV rows share the target's paged pool."""

    # Its P/D region name prefix (kv_transfer/regions.py).
    kv_region_kind = "mla"

    def __init__(self, config: DSparkDraftConfig, prefix: str) -> None:
        super().__init__(prefix)
        self.kv_cache_dim = config.kv_latent_dim
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

    def _load_q_b(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = self.heads * get_tp_group().world_size * (self.nope_dim + self.rope_dim)
        if loaded.shape[0] != rows:
            raise ValueError(
                f"q_b_proj has {loaded.shape[0]} rows, but num_attention_heads x "
                f"(qk_nope_head_dim + qk_rope_head_dim) = {rows}"
            )
        self.q_b_proj.weight_loader(param, loaded)

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
        self.write_rows(slot_mapping, self.latent_rows(context, positions))

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
        num_seqs = context_lens.shape[0]
        width = x.shape[0] // num_seqs
        # The block's latent rows read only x: on a side stream (`side_stream.py`)
        # their small kernels run beside the queries' chain.
        latent = run_beside(lambda: self.latent_rows(x, positions), x.device)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_seqs, width, self.heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = self.rotary(positions, q_pe.reshape(x.shape[0], self.heads, -1))
        block_rows = self.read_back(latent.wait())
        keys, visible = self.block_keys(
            block_rows.view(num_seqs, width, -1), block_tables, context_lens
        )
        o = latent_attention(
            q_nope,
            q_pe.view(num_seqs, width, self.heads, -1),
            keys.to(x.dtype),
            self.kv_b_proj.weight,
            self.v_dim,
            self.scale,
            visible,
        )
        o = o.reshape(x.shape[0], self.heads * self.v_dim)
        return self.o_proj(o.to(x.dtype))


class KimiK3DSpark(DSparkDraft):
    """K3DSparkModel: context projection, MLA + SwiGLU layers, final norm, Markov head.

    `embed_tokens` and `lm_head` are the target's, bound by `share_with_target`
    after loading; the checkpoint's embedding copy and confidence head are skipped.
    """

    # The attention reads kv_b_proj's weight to absorb it, so it stays unquantized.
    full_precision_linears = ("kv_b_proj",)

    # One plain class-level list, never rebound or mutated per stage.
    skip_weight_prefixes = ["confidence_head.", "embed_tokens.", "lm_head."]
    config_class = DSparkDraftConfig
    packed_modules_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def build(self, config: DSparkDraftConfig) -> None:
        hidden = config.hidden_size
        self.context_proj = ReplicatedLinear(
            config.num_taps * config.target_hidden_size, hidden
        )
        self.context_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DSparkLayer(config, DSparkAttention(config, f"layers.{i}.self_attn"))
            for i in range(config.num_hidden_layers)
        )
        self.final_norm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def project_context(self, taps_concat: torch.Tensor) -> torch.Tensor:
        """c = RMSNorm(context_proj(taps))."""
        return self.context_norm(self.context_proj(taps_concat))

    @property
    def output_norm(self) -> nn.Module:
        return self.final_norm
