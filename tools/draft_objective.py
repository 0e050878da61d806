"""DSpark's block pass written over whole sequences, differentiable (for fitting).

The engine's `DSparkDraft.block_forward` reads context rows from the paged KV cache
under inference mode, one sequence at a time. Fitting needs gradients and many
anchors per sequence, so this module evaluates the same equations (docs/dspark.md)
for a batch of sequences and a set of anchors in each, through the draft's own
submodules: context rows 0..p of an anchor come from the taps, block rows
[x_{p+1}, m, ..., m] sit at positions p+1..p+T and see each other non-causally.
Each draft attention kind has its rewrite here: Kimi's MLA (latent rows expanded by
kv_b_proj) and the Qwen3 draft's GQA (per-head q/k norms, NeoX RoPE, a sliding
window over the context). `tests/tools/test_fit_draft.py` checks both against the
engine path.
"""

from __future__ import annotations

import torch

from atom.models.dspark_base import DSparkDraft
from atom.models.kimi.dspark import DSparkAttention
from atom.models.qwen3_dspark.model import Qwen3DSparkAttention


def _expand_latent(
    attn: DSparkAttention, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latent rows [..., kv_lora + rope] -> (k_nope, v) [..., h, d] and k_pe [..., r]."""
    c_kv, k_pe = rows.split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
    kv = c_kv @ attn.kv_b_proj.weight.t()
    kv = kv.view(*rows.shape[:-1], attn.heads, attn.nope_dim + attn.v_dim)
    k_nope, v = kv.split([attn.nope_dim, attn.v_dim], dim=-1)
    return k_nope, v, k_pe


def _mla_block_attention(
    attn: DSparkAttention,
    x: torch.Tensor,
    positions: torch.Tensor,
    context: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """x [S, A, T, H] block rows (after input_layernorm) at `positions` [S, A, T];
    context [S, L, H] projected context; visible [S, A, L] context rows <= p."""
    num_seqs, num_anchors, width, hidden = x.shape
    length = context.shape[1]
    flat_positions = positions.reshape(-1)
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x.reshape(-1, hidden))))
    q = q.view(-1, attn.heads, attn.nope_dim + attn.rope_dim)
    q_nope, q_pe = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
    q_pe = attn.rotary(flat_positions, q_pe)
    shape = (num_seqs, num_anchors, width, attn.heads)
    q_nope, q_pe = q_nope.reshape(*shape, -1), q_pe.reshape(*shape, -1)

    context_positions = torch.arange(length, device=x.device).repeat(num_seqs)
    context_rows = attn.latent_rows(context.reshape(-1, hidden), context_positions)
    ck_nope, cv, ck_pe = _expand_latent(attn, context_rows.view(num_seqs, length, -1))
    block_rows = attn.latent_rows(x.reshape(-1, hidden), flat_positions)
    bk_nope, bv, bk_pe = _expand_latent(attn, block_rows.view(*shape[:3], -1))

    # Scores [S, A, heads, T, keys]: context keys first, then the T block keys.
    context_scores = torch.einsum("satnd,slnd->santl", q_nope, ck_nope)
    context_scores = context_scores + torch.einsum("satnd,sld->santl", q_pe, ck_pe)
    block_scores = torch.einsum("satnd,saund->santu", q_nope, bk_nope)
    block_scores = block_scores + torch.einsum("satnd,saud->santu", q_pe, bk_pe)
    out = _attend(
        context_scores, block_scores, visible[:, :, None, None, :], cv, bv, attn.scale
    )
    return attn.o_proj(out.reshape(-1, attn.heads * attn.v_dim)).view_as(x)


def _attend(
    context_scores: torch.Tensor,
    block_scores: torch.Tensor,
    context_mask: torch.Tensor,
    context_v: torch.Tensor,
    block_v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One softmax over the visible context keys then the whole block: scores
    [S, A, heads, T, keys], values [S, L, heads, d] and [S, A, T, heads, d];
    context_mask broadcasts to the context scores. Returns [S, A, T, heads, d]."""
    length = context_scores.shape[-1]
    context_scores = context_scores.masked_fill(~context_mask, float("-inf"))
    scores = torch.cat([context_scores, block_scores], dim=-1) * scale
    probs = scores.softmax(dim=-1)
    context_probs, block_probs = probs.split([length, block_scores.shape[-1]], -1)
    out = torch.einsum("santl,slnd->satnd", context_probs, context_v)
    return out + torch.einsum("santu,saund->satnd", block_probs, block_v)


def _gqa_block_attention(
    attn: Qwen3DSparkAttention,
    x: torch.Tensor,
    positions: torch.Tensor,
    context: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """As `_mla_block_attention`, for the Qwen3 draft: context rows are the layer's
    own k/v of the projected context, and a block row at position a sees context
    rows a - window + 1 .. p (all of 0..p without a window)."""
    num_seqs, num_anchors, width, hidden = x.shape
    length = context.shape[1]
    group = attn.num_heads // attn.num_kv_heads
    q, block_rows = attn._qkv(x.reshape(-1, hidden), positions.reshape(-1))
    context_positions = torch.arange(length, device=x.device).repeat(num_seqs)
    _, context_rows = attn._qkv(context.reshape(-1, hidden), context_positions)

    def heads(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [..., k | v] -> k, v [..., query heads, d]: query head i reads KV head i // group.
        k, v = rows.unflatten(-1, (2, attn.num_kv_heads, attn.head_dim)).unbind(-3)
        return k.repeat_interleave(group, -2), v.repeat_interleave(group, -2)

    ck, cv = heads(context_rows.view(num_seqs, length, -1))
    bk, bv = heads(block_rows.view(num_seqs, num_anchors, width, -1))
    q = q.view(num_seqs, num_anchors, width, attn.num_heads, attn.head_dim)
    context_scores = torch.einsum("satnd,slnd->santl", q, ck)
    block_scores = torch.einsum("satnd,saund->santu", q, bk)
    mask = visible.unsqueeze(-2).expand(-1, -1, width, -1)  # [S, A, T, L]
    if attn.window is not None:
        keys = torch.arange(length, device=x.device)
        mask = mask & (keys >= positions.unsqueeze(-1) - (attn.window - 1))
    out = _attend(context_scores, block_scores, mask.unsqueeze(2), cv, bv, attn.scale)
    return attn.o_proj(out.reshape(-1, attn.num_heads * attn.head_dim)).view_as(x)


_BLOCK_ATTENTION = {
    DSparkAttention: _mla_block_attention,
    Qwen3DSparkAttention: _gqa_block_attention,
}


def block_logits(
    draft: DSparkDraft,
    taps_concat: torch.Tensor,
    tokens: torch.Tensor,
    anchor_rows: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Base logits U [S, A, T, V] (fp32) of the blocks anchored at `anchor_rows`.

    taps_concat [S, L, n_taps * H_target] (tap order), tokens [S, L] and
    anchor_rows [S, A] = p, the last context row; the block input is
    [tokens[p+1], m, ..., m] at positions p+1..p+T (T = width). Padding past a
    sequence's end is never visible: every context row used is <= p.
    """
    num_seqs, length = tokens.shape
    offsets = torch.arange(1, width + 1, device=tokens.device)
    positions = anchor_rows.unsqueeze(-1) + offsets  # [S, A, T]
    block_ids = torch.full_like(positions, draft.mask_token_id)
    block_ids[..., 0] = tokens.gather(1, anchor_rows + 1)
    visible = torch.arange(length, device=tokens.device) <= anchor_rows.unsqueeze(-1)
    context = draft.project_context(taps_concat)
    h = draft.embed_tokens(block_ids)
    for layer in draft.layers:
        attention = _BLOCK_ATTENTION[type(layer.self_attn)]
        h = h + attention(
            layer.self_attn, layer.input_layernorm(h), positions, context, visible
        )
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.lm_head.compute_logits(draft.output_norm(h)).float()


def teacher_forced_logits(
    draft: DSparkDraft,
    base_logits: torch.Tensor,
    tokens: torch.Tensor,
    anchor_rows: torch.Tensor,
) -> torch.Tensor:
    """z_k = U_k + W1[x_{p+k}] W2^T with the true previous tokens (k = 1..T)."""
    width = base_logits.shape[2]
    previous_rows = anchor_rows.unsqueeze(-1) + torch.arange(
        1, width + 1, device=tokens.device
    )
    previous = tokens.gather(1, previous_rows.flatten(1)).view_as(previous_rows)
    bias = draft.markov_bias(previous.reshape(-1)).view_as(base_logits)
    return base_logits + bias


def dspark_loss(
    draft: DSparkDraft,
    taps_concat: torch.Tensor,
    tokens: torch.Tensor,
    anchor_rows: torch.Tensor,
    width: int,
    teacher_logits: torch.Tensor,
) -> torch.Tensor:
    """Cross-entropy of the teacher-forced Markov logits z_k (k = 1..T) against the
    target's distributions of x_{p+2..p+T+1}, i.e. its logits at rows p+1..p+T.

    teacher_logits [S, L, V]; every anchor needs p + T < L. Soft labels carry more
    than the argmax, and stay right where the next token was not the target's.
    """
    base = block_logits(draft, taps_concat, tokens, anchor_rows, width)
    logits = teacher_forced_logits(draft, base, tokens, anchor_rows)
    steps = torch.arange(1, width + 1, device=tokens.device)
    rows = (anchor_rows.unsqueeze(-1) + steps).flatten(1)  # p+1..p+T
    index = rows.unsqueeze(-1).expand(-1, -1, teacher_logits.shape[-1])
    teacher = teacher_logits.gather(1, index).float().softmax(dim=-1)
    log_probs = logits.log_softmax(dim=-1).reshape_as(teacher)
    return -(teacher * log_probs).sum(-1).mean()
