"""DSpark's block pass written over whole sequences, differentiable (for fitting).

The engine's `KimiK3DSpark.block_forward` reads context rows from the paged KV cache
under inference mode, one sequence at a time. Fitting needs gradients and many
anchors per sequence, so this module evaluates the same equations (docs/dspark.md)
for a batch of sequences and a set of anchors in each, through the draft's own
submodules: context rows 0..p of an anchor come from the taps, block rows
[x_{p+1}, m, ..., m] sit at positions p+1..p+T and see each other non-causally.
`tests/tools/test_fit_draft.py` checks it against the engine path.
"""

from __future__ import annotations

import torch

from atom.models.kimi.dspark import DSparkAttention, KimiK3DSpark


def _expand_latent(
    attn: DSparkAttention, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latent rows [..., kv_lora + rope] -> (k_nope, v) [..., h, d] and k_pe [..., r]."""
    c_kv, k_pe = rows.split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
    kv = c_kv @ attn.kv_b_proj.weight.t()
    kv = kv.view(*rows.shape[:-1], attn.heads, attn.nope_dim + attn.v_dim)
    k_nope, v = kv.split([attn.nope_dim, attn.v_dim], dim=-1)
    return k_nope, v, k_pe


def _block_attention(
    attn: DSparkAttention,
    x: torch.Tensor,
    positions: torch.Tensor,
    context: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """x [S, A, T, H] block rows (after input_layernorm) at `positions` [S, A, T];
    context [S, L, H] normalised context; visible [S, A, L] context rows <= p."""
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
    hidden_mask = ~visible[:, :, None, None, :]
    context_scores = context_scores.masked_fill(hidden_mask, float("-inf"))
    scores = torch.cat([context_scores, block_scores], dim=-1) * attn.scale
    probs = scores.softmax(dim=-1)
    context_probs, block_probs = probs.split([length, width], dim=-1)
    out = torch.einsum("santl,slnd->satnd", context_probs, cv)
    out = out + torch.einsum("santu,saund->satnd", block_probs, bv)
    return attn.o_proj(out.reshape(-1, attn.heads * attn.v_dim)).view_as(x)


def block_logits(
    draft: KimiK3DSpark,
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
    context = draft.context_norm(draft.context_proj(taps_concat))
    h = draft.embed_tokens(block_ids)
    for layer in draft.layers:
        h = h + _block_attention(
            layer.self_attn, layer.input_layernorm(h), positions, context, visible
        )
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.lm_head.compute_logits(draft.final_norm(h)).float()


def teacher_forced_logits(
    draft: KimiK3DSpark,
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
    draft: KimiK3DSpark,
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
