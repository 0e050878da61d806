"""Paged KV blocks: refcounts, a free list and prefix caching over full blocks.

A full block is identified by xxh64(parent hash as 8 little-endian bytes, then its
token ids as int32 little-endian); the first block has no parent bytes. A freed
block keeps its hash, so a later request can still hit it, until the block is
handed out again.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from atom.model_engine.sequence import Sequence
from atom.utils.arithmetic import ceil_div


def _token_bytes(token_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(_token_bytes(token_ids))
    return h.intdigest()


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    # Kept to rule out hash collisions on a hit.
    token_bytes: bytes | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_hash_evicted: Callable[[int], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockManager needs num_blocks >= 1 and block_size >= 1, "
                f"got {num_blocks} and {block_size}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Told when a hash stops naming a cached block (its block was reused).
        self.on_hash_evicted = on_hash_evicted
        self.blocks = [_Block(i) for i in range(num_blocks)]
        # Oldest freed first; an OrderedDict so a prefix hit can take one out.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(num_blocks)
        )
        self.hash_to_block: dict[int, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---- usage ----
    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / len(self.blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    # ---- hashing ----
    def block_hash(self, seq: Sequence, block_index: int) -> int:
        """Hash of seq's full block `block_index` (the chain is cached on seq)."""
        bs = self.block_size
        if (block_index + 1) * bs > seq.num_tokens:
            raise ValueError(
                f"block {block_index} of sequence {seq.seq_id} is not full "
                f"({seq.num_tokens} tokens, block size {bs})"
            )
        hashes = seq.block_hashes
        while len(hashes) <= block_index:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes[block_index]

    def num_cached_prefix_blocks(self, seq: Sequence) -> int:
        """Leading full blocks of seq whose KV is cached, leaving >= 1 token to run."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        count = 0
        for i in range((seq.num_tokens - 1) // bs):
            block_id = self.hash_to_block.get(self.block_hash(seq, i))
            tokens = _token_bytes(seq.token_ids[i * bs : (i + 1) * bs])
            if block_id is None or self.blocks[block_id].token_bytes != tokens:
                break
            count += 1
        return count

    # ---- allocation ----
    def _resolve_hits(self, seq: Sequence, num_cached_blocks: int | None) -> int:
        if not self.enable_prefix_caching:
            return 0
        usable = self.num_cached_prefix_blocks(seq)
        if num_cached_blocks is None:
            return usable
        if not 0 <= num_cached_blocks <= usable:
            raise ValueError(
                f"num_cached_blocks={num_cached_blocks} but only {usable} leading "
                f"blocks of sequence {seq.seq_id} are cached"
            )
        return num_cached_blocks

    def can_allocate(
        self,
        seq: Sequence,
        num_cached_blocks: int | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        hits = self._resolve_hits(seq, num_cached_blocks)
        needed = self.num_blocks_for(seq.num_tokens + num_lookahead_tokens)
        hits_in_use = sum(
            self.blocks[self.hash_to_block[self.block_hash(seq, i)]].ref_count > 0
            for i in range(hits)
        )
        # A hit on a free block still takes that block off the free list.
        return needed - hits_in_use <= self.num_free_blocks

    def allocate(
        self,
        seq: Sequence,
        num_cached_blocks: int | None = None,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """Give seq blocks for all its tokens (+ lookahead), reusing cached ones.

        `num_cached_blocks` (default: every cached leading block) lets the caller
        use a shorter hit, e.g. one that ends where a recurrent state is saved.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if not self.can_allocate(seq, num_cached_blocks, num_lookahead_tokens):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}")
        hits = self._resolve_hits(seq, num_cached_blocks)
        for i in range(hits):
            block = self.blocks[self.hash_to_block[self.block_hash(seq, i)]]
            if block.ref_count == 0:
                del self.free_block_ids[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        needed = self.num_blocks_for(seq.num_tokens + num_lookahead_tokens)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = hits * self.block_size
        seq.num_hashed_blocks = hits
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_cached_tokens

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.on_hash_evicted is not None:
                    self.on_hash_evicted(block.hash)
            block.hash = None
            block.token_bytes = None
        block.ref_count = 1
        return block_id

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks go to the free list first so they are reused first and the
        # shareable prefix blocks survive longer.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0

    def try_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Cover positions up to num_tokens-1+num_new_tokens and cache full blocks,
        or return False, changing nothing, when too few blocks are free. One
        test and one count: this runs per sequence per decode step.

        Speculative rows need slots before acceptance is known; blocks past the
        committed length stay with the sequence and are simply overwritten later.
        """
        missing = self.num_blocks_for(seq.num_tokens + num_new_tokens) - len(
            seq.block_table
        )
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())
        self.cache_full_blocks(seq, seq.num_tokens)
        return True

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks lying entirely within seq's first num_tokens tokens.

        Call it only for tokens that are committed and whose KV is written by a
        batch already scheduled: a later batch may then read the block.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_tokens, seq.num_tokens) // bs
        for i in range(seq.num_hashed_blocks, min(num_full, len(seq.block_table))):
            block = self.blocks[seq.block_table[i]]
            block.hash = self.block_hash(seq, i)
            block.token_bytes = _token_bytes(seq.token_ids[i * bs : (i + 1) * bs])
            self.hash_to_block[block.hash] = block.block_id
            seq.num_hashed_blocks = i + 1
