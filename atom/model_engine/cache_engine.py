"""Allocates the paged KV cache and the recurrent state slots, and binds them to layers.

What a layer declares to get either is `atom/models/interfaces.py`: a
`PagedKVLayer` gets its rows of the paged pool, a `RecurrentStateLayer` a tensor
per slot for each `StateTensor` of its `state_spec()` and, with speculation, the
snapshot after each verify row. The engine keeps the tensors it allocated, so
rolling back and forking states reads no layer attribute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from atom.models.interfaces import PagedKVLayer, RecurrentStateLayer, StateTensor


def kv_layers(modules: list[nn.Module]) -> list[PagedKVLayer]:
    return [
        m for root in modules for m in root.modules() if isinstance(m, PagedKVLayer)
    ]


def state_layers(modules: list[nn.Module]) -> list[RecurrentStateLayer]:
    return [
        m
        for root in modules
        for m in root.modules()
        if isinstance(m, RecurrentStateLayer)
    ]


@dataclass(frozen=True)
class StateStack:
    """One kind of recurrent state (a `StateTensor`) of every layer that keeps it:
    [layers, slots, *shape], and with speculation the snapshot after each verify
    row, [layers, slots, rows, *shape]. Each layer binds its own slice."""

    states: torch.Tensor
    snapshots: torch.Tensor | None


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
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: the model dtype (states that name none); `kv_dtype`: the paged
        rows' dtype for layers that name none (`--kv-cache-dtype`), None: `dtype`."""
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
        self.kv_dtype = kv_dtype or dtype
        self.device = torch.device(device)
        self.kv_layers = kv_layers(modules)
        self.state_layers = state_layers(modules)
        # One scratch block and one scratch state slot past the usable ones: the
        # dummy sequences that pad a captured graph's batch write there.
        self.scratch_kv_slot = num_blocks * block_size
        self.scratch_state_slot = num_state_slots
        blocks, slots = num_blocks + 1, num_state_slots + 1
        for layer in self.kv_layers:
            layer.bind_kv_cache(
                torch.zeros(
                    blocks,
                    block_size,
                    layer.kv_cache_dim,
                    dtype=self.layer_kv_dtype(layer),
                    device=device,
                )
            )
        # Per state layer: {name: [slots, *shape]} and {name: [slots, rows, *shape]},
        # views of one stacked tensor per kind of state (`StateStack`), so a
        # commit or a copy costs two launches per kind, not per layer.
        self.states: list[dict[str, torch.Tensor]] = [{} for _ in self.state_layers]
        self.snapshots: list[dict[str, torch.Tensor]] = [{} for _ in self.state_layers]
        members: dict[StateTensor, list[int]] = {}
        for index, layer in enumerate(self.state_layers):
            for tensor in layer.state_spec():
                members.setdefault(tensor, []).append(index)
        self.state_stacks: list[StateStack] = []
        for tensor, layers in members.items():
            stack = StateStack(
                self._zeros(tensor, (len(layers), slots)),
                (
                    self._zeros(tensor, (len(layers), slots, num_verify_rows))
                    if num_verify_rows
                    else None
                ),
            )
            self.state_stacks.append(stack)
            for position, index in enumerate(layers):
                self.states[index][tensor.name] = stack.states[position]
                if stack.snapshots is not None:
                    self.snapshots[index][tensor.name] = stack.snapshots[position]
        for layer, states, snapshots in zip(
            self.state_layers, self.states, self.snapshots
        ):
            layer.bind_states(states, snapshots if num_verify_rows else None)

    def layer_kv_dtype(self, layer: PagedKVLayer) -> torch.dtype:
        return layer.kv_cache_dtype or self.kv_dtype

    def _zeros(self, tensor: StateTensor, lead: tuple[int, ...]) -> torch.Tensor:
        dtype = tensor.dtype or self.dtype
        return torch.zeros(*lead, *tensor.shape, dtype=dtype, device=self.device)

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
        for stack in self.state_stacks:
            stack.states.index_copy_(1, dst, stack.states.index_select(1, src))

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
        self.commit_rows(self._slot_tensor(slots), self._slot_tensor(num_rows) - 1)

    def commit_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """`commit` with device indices: each slot's state becomes its snapshot
        `rows` (0-based), as async scheduling commits before the host knows them."""
        for stack in self.state_stacks:
            stack.states.index_copy_(1, slots, stack.snapshots[:, slots, rows])

    def kv_bytes_per_block(self) -> int:
        return sum(
            self.block_size
            * layer.kv_cache_dim
            * self._element_size(self.layer_kv_dtype(layer))
            for layer in self.kv_layers
        )

    def state_bytes_per_slot(self) -> int:
        """A slot's state and, with speculation, its snapshot rows."""
        rows = 1 + self.num_verify_rows
        return sum(
            rows * math.prod(t.shape) * self._element_size(t.dtype)
            for layer in self.state_layers
            for t in layer.state_spec()
        )

    def _element_size(self, dtype: torch.dtype | None) -> int:
        return torch.empty(0, dtype=dtype or self.dtype).element_size()
