"""What every DSpark draft shares: the target's embedding and LM head, the layer, the
context rows, the block pass and the Markov head.

A DSpark draft was trained against the frozen target table and has no LM head of its
own, so after its weights load it binds the target's `embed_tokens` and `lm_head` by
object reference (docs/pp_dspark.md, "Binding"). The bound modules stay *outside* the
draft's module tree: `draft.parameters()`, `state_dict()` and the loader's accounting
see only the draft's own weights, the memory ledger does not count the table twice,
and `.to()` on the target moves the shared modules in place (the draft keeps pointing
at the same module objects). The target owns them; the draft never moves or loads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from atom.model_ops.activation import SiluAndMul
from atom.model_ops.gated_mlp import GatedMLP
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import ReplicatedLinear
from atom.model_ops.paged_cache import (
    DEFAULT_KV_SCALE,
    gather_kv,
    read_back_kv,
    write_kv,
)
from atom.model_ops.visibility import block_pass_visibility
from atom.utils.forward_context import ForwardContext, set_forward_context


class SharedEmbeddingDraft(nn.Module):
    """Base of drafts that embed with the target's table and score with its LM head.

    Subclasses set `self.vocab_size`. `embed_tokens` and `lm_head` are None until
    `share_with_target`; a context-only producer never binds them.
    """

    # The attribute `check_shared_embedding` inspects after binding.
    shared_embedding_attr = "embed_tokens"

    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = 0
        self._bind_shared("embed_tokens", None)
        self._bind_shared("lm_head", None)

    def _bind_shared(self, name: str, module: nn.Module | None) -> None:
        # object.__setattr__ skips nn.Module's registration: the module stays the
        # target's, so it is neither a draft parameter nor moved by `draft.to()`.
        object.__setattr__(self, name, module)

    def validate_target_vocab(self, target_base: nn.Module) -> int:
        """Raise ValueError unless the target's vocabulary equals the draft's."""
        # `model.vocab_size` is set on every stage (`PipelineTextStack.build_stage`);
        # `embed_tokens.num_embeddings` is not read: on a stage whose embedding is a
        # PPMissingLayer it raises and hides the placement error reported next.
        vocab = target_base.model.vocab_size
        if vocab != self.vocab_size:
            raise ValueError(
                f"draft vocab_size {self.vocab_size} differs from the target's "
                f"vocab_size {vocab}; the draft must score the target's vocabulary"
            )
        return vocab

    def share_with_target(self, target_base: nn.Module) -> None:
        """Bind the target's `model.embed_tokens` and `lm_head` (the same objects).

        Validates the vocabulary first. Placement (a PPMissingLayer where the table
        should be) is `check_shared_embedding`'s job, so binding one succeeds here.
        """
        self.validate_target_vocab(target_base)
        self._bind_shared("embed_tokens", target_base.model.embed_tokens)
        self._bind_shared("lm_head", target_base.lm_head)

    def shared_parameter_bytes(self) -> int:
        """Bytes of the bound target modules (owned and counted by the target)."""
        total = 0
        for module in (self.embed_tokens, self.lm_head):
            if module is not None:
                total += sum(p.numel() * p.element_size() for p in module.parameters())
        return total


class MarkovHead(nn.Module):
    """Low-rank first-order transition bias: bias(prev) = W1[prev] @ W2^T (fp32)."""

    # Tables indexed by token, not products: quantization leaves them alone.
    full_precision_linears = ("markov_w1", "markov_w2")

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        # Both tables are [V, r]; replicated, since a sharded W2 would need a gather
        # per drafted position.
        self.markov_w1 = ReplicatedLinear(rank, vocab_size)
        self.markov_w2 = ReplicatedLinear(rank, vocab_size)

    def bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[B] previous tokens -> [B, V] fp32 logit bias."""
        w1 = self.markov_w1.weight[prev_ids].float()
        return w1 @ self.markov_w2.weight.float().t()


class DraftAttention(nn.Module):
    """Base of a draft's attention: its KV rows live in the target's paged pool.

    A `PagedKVLayer` (models/interfaces.py): a subclass sets `kv_cache_dim` (the
    width of its cache rows) and reaches the bound cache through `cache()`.
    """

    kv_cache_dim: int

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.kv_cache_dtype: torch.dtype | None = None
        self.kv_scale = DEFAULT_KV_SCALE
        self.kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(
                f"draft attention {self.prefix!r} has no KV cache; bind one with "
                "CacheEngine before writing or reading context rows"
            )
        return self.kv_cache

    def write_rows(self, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """Store context rows [N, kv_cache_dim] at their slots."""
        write_kv(self.cache(), slot_mapping, rows, self.kv_scale)

    def read_back(self, rows: torch.Tensor) -> torch.Tensor:
        """Block rows as the cache would return them (they are never written)."""
        return read_back_kv(rows, self.cache(), self.kv_scale, rows.dtype)

    def block_keys(
        self,
        block_rows: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        window: tuple[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a block pass attends to: (keys [B, C + T, kv_cache_dim], visible
        [B, T, C + T] bool).

        Keys are each sequence's cached context rows (gathered through
        `block_tables`) then its T `block_rows` [B, T, kv_cache_dim], which the
        caller rounds through the cache (`read_back`) as a write would;
        `visible` is `block_pass_visibility` (`window`: size, positions).
        """
        context = gather_kv(self.cache(), block_tables, self.kv_scale, block_rows.dtype)
        visible = block_pass_visibility(
            context_lens, context.shape[1], block_rows.shape[1], window
        )
        return torch.cat([context, block_rows], dim=1), visible


class DSparkLayer(nn.Module):
    """Pre-norm attention (the draft's own kind) then a SiLU-gated MLP."""

    def __init__(self, config: Any, self_attn: DraftAttention) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.self_attn = self_attn
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


class DSparkDraft(SharedEmbeddingDraft):
    """A DSpark draft: context rows from the target's taps, a non-causal block pass
    over [x0, m, ..., m] and the Markov head.

    A subclass sets `config_class` and defines `build` (its context projection,
    `self.layers` of DSparkLayer and its final norm), `project_context` (taps ->
    context rows) and `output_norm` (the final norm).
    """

    config_class: type

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
        self.build(config)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)

    def build(self, config: Any) -> None:
        raise NotImplementedError

    def project_context(self, taps_concat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def output_norm(self) -> nn.Module:
        raise NotImplementedError

    def write_context_kv(
        self,
        taps_concat: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write every draft layer's context rows for one target forward.

        taps_concat [N, n_taps * H_target] in tap order; the projected context goes
        straight into each layer's attention, without its input norm.
        """
        expected = self.config.num_taps * self.config.target_hidden_size
        if taps_concat.dim() != 2 or taps_concat.shape[1] != expected:
            raise ValueError(
                f"taps_concat must be [N, {expected}], got {tuple(taps_concat.shape)}"
            )
        context = self.project_context(taps_concat)
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
        # is_draft: tap hooks on the shared embedding must not record the block.
        with set_forward_context(ForwardContext(is_draft=True)):
            h = self.embed_tokens(block_ids.reshape(-1))
            for layer in self.layers:
                h = layer(h, positions, block_tables, anchor_positions)
            logits = self.lm_head.compute_logits(self.output_norm(h))
        return logits.float().view(num_seqs, width, -1)

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_head.bias(prev_ids)
