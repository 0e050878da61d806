"""Allocates the paged MLA KV cache and the KDA state slots, and binds them to layers.

Layers declare what they need and receive tensors as attributes:
- `kv_cache_dim: int` (MLA, target or draft) -> `.kv_cache` [blocks, block_size, dim];
- `state_shapes() -> (conv, ssm)` (KDA) -> `.conv_state` [slots, *conv] (model dtype),
  `.ssm_state` [slots, *ssm] (fp32) and, with speculation, `.conv_snapshots` /
  `.ssm_snapshots` [slots, rows, ...]: the state after each verify row.
"""

from __future__ import annotations

import torch
from torch import nn


def kv_layers(modules: list[nn.Module]) -> list[nn.Module]:
    return [m for root in modules for m in root.modules() if hasattr(m, "kv_cache_dim")]


def state_layers(modules: list[nn.Module]) -> list[nn.Module]:
    return [m for root in modules for m in root.modules() if hasattr(m, "state_shapes")]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


class CacheEngine:
    def __init__(
        self,
        modules: list[nn.Module],
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        num_verify_rows: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        for name, value in (
            ("num_blocks", num_blocks),
            ("num_state_slots", num_state_slots),
            ("num_verify_rows", num_verify_rows),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.num_verify_rows = num_verify_rows
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_layers = kv_layers(modules)
        self.state_layers = state_layers(modules)
        # One scratch block and one scratch state slot past the usable ones: the
        # dummy sequences that pad a captured graph's batch write there.
        self.scratch_kv_slot = num_blocks * block_size
        self.scratch_state_slot = num_state_slots
        blocks, slots = num_blocks + 1, num_state_slots + 1
        for layer in self.kv_layers:
            layer.kv_cache = torch.zeros(
                blocks, block_size, layer.kv_cache_dim, dtype=dtype, device=device
            )
        for layer in self.state_layers:
            conv, ssm = layer.state_shapes()
            layer.conv_state = torch.zeros(slots, *conv, dtype=dtype, device=device)
            layer.ssm_state = torch.zeros(
                slots, *ssm, dtype=torch.float32, device=device
            )
            # Rebinding replaces everything, so no buffer of an older engine lingers.
            layer.conv_snapshots = layer.ssm_snapshots = None
            if num_verify_rows:
                layer.conv_snapshots = torch.zeros(
                    slots, num_verify_rows, *conv, dtype=dtype, device=device
                )
                layer.ssm_snapshots = torch.zeros(
                    slots, num_verify_rows, *ssm, dtype=torch.float32, device=device
                )

    def _check_slots(self, slots: list[int], what: str) -> None:
        bad = [s for s in slots if not 0 <= s < self.num_state_slots]
        if bad:
            raise ValueError(
                f"{what} state slots {bad} outside [0, {self.num_state_slots})"
            )

    def _slot_tensor(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def copy_states(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy every KDA layer's conv and recurrent state from each source slot to
        its destination (prefix forks and checkpoint saves), one copy per layer."""
        if len(src_slots) != len(dst_slots):
            raise ValueError(
                f"{len(src_slots)} source slots for {len(dst_slots)} destinations"
            )
        if not src_slots:
            return
        self._check_slots(src_slots, "source")
        self._check_slots(dst_slots, "destination")
        src, dst = self._slot_tensor(src_slots), self._slot_tensor(dst_slots)
        for layer in self.state_layers:
            layer.conv_state.index_copy_(0, dst, layer.conv_state.index_select(0, src))
            layer.ssm_state.index_copy_(0, dst, layer.ssm_state.index_select(0, src))

    def commit(self, slots: list[int], num_rows: list[int]) -> None:
        """After a verify forward: each slot's state becomes the one after its row
        `num_rows - 1` (the last token kept: the anchor plus the accepted drafts)."""
        if len(slots) != len(num_rows):
            raise ValueError(f"{len(slots)} slots for {len(num_rows)} row counts")
        if not slots:
            return
        self._check_slots(slots, "commit")
        bad = [n for n in num_rows if not 1 <= n <= self.num_verify_rows]
        if bad:
            raise ValueError(
                f"commit of {bad} rows outside [1, {self.num_verify_rows}] "
                "(the snapshot rows bound)"
            )
        slot_index = self._slot_tensor(slots)
        row_index = self._slot_tensor(num_rows) - 1
        for layer in self.state_layers:
            layer.conv_state.index_copy_(
                0, slot_index, layer.conv_snapshots[slot_index, row_index]
            )
            layer.ssm_state.index_copy_(
                0, slot_index, layer.ssm_snapshots[slot_index, row_index]
            )

    def kv_bytes_per_block(self) -> int:
        element = torch.empty(0, dtype=self.dtype).element_size()
        return sum(
            self.block_size * layer.kv_cache_dim * element for layer in self.kv_layers
        )

    def state_bytes_per_slot(self) -> int:
        model_bytes = torch.empty(0, dtype=self.dtype).element_size()
        rows = 1 + self.num_verify_rows
        total = 0
        for layer in self.state_layers:
            conv, ssm = layer.state_shapes()
            total += rows * (_numel(conv) * model_bytes + _numel(ssm) * 4)
        return total
