"""What a layer or a model declares to the engine: the contract in one file.

A layer gets a cache by declaring one of two kinds; the `CacheEngine`
(`model_engine/cache_engine.py`) finds it by these Protocols, allocates what it
declares, and hands it its views through one binding call:

- `PagedKVLayer`: one row per token in the shared paged pool, `kv_cache_dim`
  elements wide in `kv_cache_dtype` (None: the engine's KV dtype, which
  `--kv-cache-dtype` picks: the model dtype or fp8) and, in an fp8 cache, stored
  as value / `kv_scale` (`model_ops/paged_cache.py`); bound as
  `bind_kv_cache(cache [num_blocks + 1, block_size, kv_cache_dim])`.
- `RecurrentStateLayer`: per request slot, the tensors `state_spec()` names; bound
  as `bind_states(states, snapshots)`, each `states[name]` [slots + 1, *shape] and,
  with speculation, `snapshots[name]` [slots + 1, verify rows, *shape]: the state
  after each verify row, from which `CacheEngine.commit` keeps the accepted one.

The extra block and slot are scratch for the padding rows of captured graphs.

A decoder layer a DSpark draft may tap is a `TapLayer`. A module whose forward syncs
with the host (so a CUDA graph cannot capture it) declares `graph_capturable` False
(`GraphCaptureAware`); modules that declare nothing are capturable. A target model
is a `PipelineModel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from atom.models.utils import IntermediateTensors


# How a verify's recurrent state is rolled back, named in the start-up logs of the
# runner and the drafter (the CI log reader matches it).
STATE_ROLLBACK_MODE = "per-row snapshots"


@dataclass(frozen=True)
class StateTensor:
    """One tensor a recurrent layer keeps per request slot."""

    name: str
    shape: tuple[int, ...]
    # None: the model dtype.
    dtype: torch.dtype | None = None


@runtime_checkable
class PagedKVLayer(Protocol):
    kv_cache_dim: int
    kv_cache_dtype: torch.dtype | None
    kv_scale: float

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None: ...


@runtime_checkable
class RecurrentStateLayer(Protocol):
    def state_spec(self) -> tuple[StateTensor, ...]: ...

    def bind_states(
        self,
        states: dict[str, torch.Tensor],
        snapshots: dict[str, torch.Tensor] | None,
    ) -> None: ...


@runtime_checkable
class TapLayer(Protocol):
    """A decoder layer a DSpark draft may tap (`spec_decode/aux_capture.py`)."""

    def aux_hidden_state(self, output: Any) -> torch.Tensor:
        """The tapped rows [N, H] (the post-layer residual stream) of the layer's
        forward output."""
        ...


@runtime_checkable
class GraphCaptureAware(Protocol):
    # May be a property: whether capture is possible can depend on the device.
    graph_capturable: bool


def is_graph_capturable(module: nn.Module) -> bool:
    return not isinstance(module, GraphCaptureAware) or module.graph_capturable


@runtime_checkable
class PipelineModel(Protocol):
    """A target model: this stage's layers under pipeline x tensor parallelism.

    `forward` returns hidden states on the last stage, else IntermediateTensors
    with `pp_payload_keys`; `compute_logits` gives the full vocabulary there.
    """

    pp_payload_keys: tuple[str, ...]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device | str
    ) -> IntermediateTensors: ...
