"""Which keys each query row may attend to: every attention's mask is built here.

A mask is bool, True where the query row sees the key; queries are padded per
sequence [B, Q] and keys are a sequence's rows in position order [B, S].
- `causal_visibility`: a query at position p sees key rows 0..p (target MLA);
- `sequence_visibility`: the same, never past the sequence's last row in this
  forward (target GQA, whose gathered blocks may hold an earlier owner's rows;
  `sequence_key_ends` gives that bound to the kernels that walk the tables);
- `block_pass_visibility`: a DSpark block pass, context rows then the whole block.
Block-sparse selection (`block_sparse.py`) narrows a mask built here.
"""

from __future__ import annotations

import torch

from atom.utils.forward_context import AttentionMetadata


def causal_visibility(query_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, Q, S] bool: a query at position p sees key rows 0..p."""
    keys = torch.arange(num_keys, device=query_positions.device)
    return keys.view(1, 1, -1) <= query_positions.unsqueeze(-1)


def sequence_visibility(metadata: AttentionMetadata, num_keys: int) -> torch.Tensor:
    """[B, Q, S] bool: a query at position p sees its sequence's key rows 0..p.

    Keys past the sequence's last row in this forward are never visible, not even to
    a padded query row: a gathered block holds whatever an earlier owner wrote there.
    """
    visible = causal_visibility(metadata.query_positions, num_keys)
    ends = sequence_key_ends(metadata)
    keys = torch.arange(num_keys, device=ends.device)
    return visible & (keys.unsqueeze(0) < ends.unsqueeze(1)).unsqueeze(1)


def sequence_key_ends(metadata: AttentionMetadata) -> torch.Tensor:
    """[B]: the key rows a sequence holds after this forward's writes (its cached
    rows plus its rows here); keys at or past its end are never visible."""
    return metadata.context_lens + metadata.query_start_loc.diff()


def block_pass_visibility(
    context_lens: torch.Tensor,
    num_context: int,
    width: int,
    window: tuple[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """[B, T, C + T] bool over C gathered context rows then T block rows: row t of
    sequence b sees context rows 0..context_lens[b]-1 and every block row (no causal
    mask inside the block); `window` (size, positions [B*T]) limits the context to
    the last `size` positions up to each row's own."""
    num_seqs = context_lens.shape[0]
    context_index = torch.arange(num_context, device=context_lens.device)
    seen = context_index < context_lens.view(-1, 1, 1)
    if window is not None:
        size, positions = window
        first = positions.view(num_seqs, width, 1) - (size - 1)
        seen = seen & (context_index >= first)
    block = seen.new_ones(num_seqs, width, width)
    return torch.cat([seen.expand(-1, width, -1), block], dim=-1)
