"""Lightning-indexer block selection for block-sparse attention, batched.

For each query row and index head g (one per KV group): score every visible key k
as s = iq_g . ik_k in fp32, pool the scores of each block of `block_size` positions
by max, force the query's own block (and `local_blocks - 1` before it) and the first
`init_blocks` blocks in with +inf, and keep the `topk_blocks` best blocks; forced
blocks take slots out of the `topk_blocks`. Blocks are anchored to absolute
positions, so key row s (position s) lies in block s // block_size. Ties prefer the
lower block. The query heads of group g then attend only to visible keys of the
kept blocks.

Everything runs on tensors, with no host synchronisation, for all sequences at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom.utils.arithmetic import ceil_div


@dataclass(frozen=True)
class IndexerConfig:
    """The lightning indexer of the sparse layers."""

    num_heads: int
    head_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int
    init_blocks: int


def pooled_block_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, visible: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[B, G, Q, num_blocks] fp32: each block's best visible index score (-inf when
    it holds no visible key)."""
    num_keys = index_k.shape[1]
    num_blocks = ceil_div(num_keys, block_size)
    scores = torch.einsum("bqgd,bsd->bgqs", index_q.float(), index_k.float())
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    pad = num_blocks * block_size - num_keys
    if pad:
        scores = F.pad(scores, (0, pad), value=float("-inf"))
    return scores.unflatten(-1, (num_blocks, block_size)).amax(dim=-1)


def kept_blocks(
    block_scores: torch.Tensor, query_positions: torch.Tensor, indexer: IndexerConfig
) -> torch.Tensor:
    """[B, G, Q, num_blocks] bool: the key blocks each query row keeps per head."""
    num_blocks = block_scores.shape[-1]
    blocks = torch.arange(num_blocks, device=block_scores.device)
    own = (query_positions // indexer.block_size).unsqueeze(-1)
    recent = blocks > own - indexer.local_blocks
    forced = (blocks <= own) & (recent | (blocks < indexer.init_blocks))
    block_scores = block_scores.masked_fill(forced.unsqueeze(1), float("inf"))
    # A stable descending sort keeps the lower block first among equal scores.
    order = block_scores.sort(dim=-1, descending=True, stable=True).indices
    chosen = order[..., : min(indexer.topk_blocks, num_blocks)]
    keep = torch.zeros_like(block_scores, dtype=torch.bool)
    keep.scatter_(-1, chosen, True)
    # Blocks with no visible key (past the query) never count, even when chosen.
    return keep & (block_scores > float("-inf"))


def block_sparse_visibility(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    visible: torch.Tensor,
    query_positions: torch.Tensor,
    indexer: IndexerConfig,
) -> torch.Tensor:
    """[B, G, Q, S] bool: `visible` restricted to each head's kept key blocks.

    index_q [B, Q, G, D]; index_k [B, S, D] (one key head); visible [B, Q, S];
    query_positions [B, Q].
    """
    block_scores = pooled_block_scores(index_q, index_k, visible, indexer.block_size)
    keep = kept_blocks(block_scores, query_positions, indexer)
    num_keys = index_k.shape[1]
    per_key = keep.repeat_interleave(indexer.block_size, dim=-1)[..., :num_keys]
    return per_key & visible.unsqueeze(1)
