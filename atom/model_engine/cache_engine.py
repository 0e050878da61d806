"""Allocates the paged MLA KV cache and the KDA state slots, and binds them to layers.

Layers declare what they need and receive tensors as attributes:
- `kv_cache_dim: int` (MLA, target or draft) -> `.kv_cache` [blocks, block_size, dim];
- `state_shapes() -> (conv, ssm)` (KDA) -> `.conv_state` [slots, *conv] (model dtype),
  `.ssm_state` [slots, *ssm] (fp32) and, with speculation, `.conv_snapshots` /
  `.ssm_snapshots` [slots, rows, ...]: the state after each verify row.
"""

from __future__ import annotations

import sys

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
        num_spec_rows: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        for name, value in (
            ("num_blocks", num_blocks),
            ("num_state_slots", num_state_slots),
            ("num_spec_rows", num_spec_rows),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.num_spec_rows = num_spec_rows
        self.dtype = dtype
        self.kv_layers = kv_layers(modules)
        self.state_layers = state_layers(modules)
        for layer in self.kv_layers:
            layer.kv_cache = torch.zeros(
                num_blocks, block_size, layer.kv_cache_dim, dtype=dtype, device=device
            )
        for layer in self.state_layers:
            conv, ssm = layer.state_shapes()
            layer.conv_state = torch.zeros(
                num_state_slots, *conv, dtype=dtype, device=device
            )
            layer.ssm_state = torch.zeros(
                num_state_slots, *ssm, dtype=torch.float32, device=device
            )
            # Rebinding replaces everything, so no buffer of an older engine lingers.
            layer.conv_snapshots = layer.ssm_snapshots = None
            if num_spec_rows:
                layer.conv_snapshots = torch.zeros(
                    num_state_slots, num_spec_rows, *conv, dtype=dtype, device=device
                )
                layer.ssm_snapshots = torch.zeros(
                    num_state_slots,
                    num_spec_rows,
                    *ssm,
                    dtype=torch.float32,
                    device=device,
                )

    def _check_slot(self, slot: int, what: str) -> None:
        if not 0 <= slot < self.num_state_slots:
            raise ValueError(
                f"{what} state slot {slot} outside [0, {self.num_state_slots})"
            )

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy every KDA layer's conv and recurrent state (fork or checkpoint save)."""
        self._check_slot(src_slot, "source")
        self._check_slot(dst_slot, "destination")
        for layer in self.state_layers:
            layer.conv_state[dst_slot].copy_(layer.conv_state[src_slot])
            layer.ssm_state[dst_slot].copy_(layer.ssm_state[src_slot])

    def commit(self, slot: int, num_rows: int) -> None:
        """After a verify forward: the state becomes the one after row `num_rows - 1`
        (the last token kept: the verified anchor plus the accepted drafts)."""
        self._check_slot(slot, "commit")
        if not 1 <= num_rows <= self.num_spec_rows:
            raise ValueError(
                f"commit of {num_rows} rows outside [1, {self.num_spec_rows}] "
                "(the snapshot rows bound)"
            )
        for layer in self.state_layers:
            layer.conv_state[slot].copy_(layer.conv_snapshots[slot, num_rows - 1])
            layer.ssm_state[slot].copy_(layer.ssm_snapshots[slot, num_rows - 1])

    def kv_bytes_per_block(self) -> int:
        return _kv_bytes_per_block(self.kv_layers, self.block_size, self.dtype)

    def state_bytes_per_slot(self) -> int:
        model_bytes = torch.empty(0, dtype=self.dtype).element_size()
        rows = 1 + self.num_spec_rows
        total = 0
        for layer in self.state_layers:
            conv, ssm = layer.state_shapes()
            total += rows * (_numel(conv) * model_bytes + _numel(ssm) * 4)
        return total

    @staticmethod
    def num_blocks_for_budget(
        modules: list[nn.Module],
        block_size: int,
        budget_bytes: int,
        dtype: torch.dtype | None = None,
    ) -> int:
        """KV blocks that fit `budget_bytes` (sys.maxsize when no layer needs KV, so a
        minimum over pipeline stages ignores a KV-free stage)."""
        dtype = dtype or torch.get_default_dtype()
        per_block = _kv_bytes_per_block(kv_layers(modules), block_size, dtype)
        if per_block == 0:
            return sys.maxsize
        return max(0, budget_bytes // per_block)


def _kv_bytes_per_block(
    layers: list[nn.Module], block_size: int, dtype: torch.dtype
) -> int:
    element = torch.empty(0, dtype=dtype).element_size()
    return sum(block_size * layer.kv_cache_dim * element for layer in layers)
