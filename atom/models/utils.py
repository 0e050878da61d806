"""Pipeline-parallel building blocks shared by every model."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from atom.config import Config, is_context_only_producer, validate_partition
from atom.distributed.parallel_state import get_pp_group
from atom.models.registry import serves_pp_speculation


class PPMissingLayer(nn.Identity):
    """Stands in for a module another pipeline stage owns; holds no parameters."""

    def __init__(self, *args, return_tuple: bool = False, **kwargs) -> None:
        super().__init__()
        self.return_tuple = return_tuple

    def forward(self, *args, **kwargs):
        value = args[0] if args else next(iter(kwargs.values()))
        return (value,) if self.return_tuple else value


def get_pp_indices(
    num_layers: int, pp_rank: int, pp_size: int, partition: list[int] | None = None
) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` owns.

    `partition` is `Config.pp_layer_partition` (the user's or the environment's).
    Without one, remainder layers go to the stages just before the last, never to the
    last stage, which also carries the norm, the LM head and the drafter.
    """
    if partition is not None:
        parts = list(partition)
    else:
        parts = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            parts[pp_size - 2 - i] += 1
    validate_partition(parts, num_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def make_layers(
    num_layers: int,
    layer_fn: Callable[[str], nn.Module],
    prefix: str,
    partition: list[int] | None = None,
) -> tuple[int, int, nn.ModuleList]:
    """Build this stage's layers; other slots hold PPMissingLayer (global indices)."""
    pp = get_pp_group()
    start, end = get_pp_indices(num_layers, pp.rank_in_group, pp.world_size, partition)
    layers = [
        layer_fn(f"{prefix}.{i}") if start <= i < end else PPMissingLayer()
        for i in range(num_layers)
    ]
    return start, end, nn.ModuleList(layers)


def maybe_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def missing_layer_prefixes(model: nn.Module) -> list[str]:
    """Dot-terminated names of every PPMissingLayer, so `layers.1.` never hits `layers.11.`."""
    return [
        f"{name}."
        for name, module in model.named_modules()
        if isinstance(module, PPMissingLayer)
    ]


def is_pp_missing_parameter(name: str, prefixes: list[str]) -> bool:
    return any(name.startswith(prefix) for prefix in prefixes)


def language_model_of(model: nn.Module) -> nn.Module:
    """The text model (with `.model` and `.lm_head`) inside a multimodal wrapper."""
    return getattr(model, "language_model", model)


def pp_holds_embedding(config: Config) -> bool:
    """Does this stage build a real `embed_tokens`?

    The first stage always does. The last stage does only when a drafter that shares
    the target's embedding runs there (the registry's `pp_speculative_methods`), and
    never on a context-only producer, which proposes nothing. Middle stages never do.
    """
    pp = get_pp_group()
    if pp.is_first_rank:
        return True
    if not pp.is_last_rank:
        return False
    return serves_pp_speculation(config) and not is_context_only_producer(config)


class IntermediateTensors:
    """Named tensors one pipeline stage hands to the next."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    def __getitem__(self, key: str | slice):
        if isinstance(key, slice):
            return IntermediateTensors({k: v[key] for k, v in self.tensors.items()})
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def items(self):
        return self.tensors.items()

    def keys(self):
        return self.tensors.keys()

    def pop(self, key: str, default=None):
        return self.tensors.pop(key, default)

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"IntermediateTensors({shapes})"
