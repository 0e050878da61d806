"""Rows of a paged cache: every attention's KV rows are written and read here.

A cache is [num_blocks, block_size, D]: one row of width D per token (an MLA latent
row, a GQA layer's keys and values, a draft's context row). A sequence's block table
names its blocks in position order; slot = block * block_size + offset.
"""

from __future__ import annotations

import torch


def write_kv(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor
) -> None:
    """Store `rows` [N, D] at flat slots (block * block_size + offset).

    Caches hold values only: what is written carries no autograd history.
    """
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, slot_mapping, rows.detach().to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, W * block_size, D]: every sequence's cached rows in position order."""
    num_seqs, width = block_tables.shape
    rows = kv_cache.index_select(0, block_tables.reshape(-1))
    return rows.view(num_seqs, width * kv_cache.shape[1], kv_cache.shape[2])
