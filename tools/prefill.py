"""Whole-sequence forwards through atom's own model code, for training and tracing.

The model is built by the registry and loaded by the strict loader, and each forward
goes through the engine's entry points (`prepare_inputs`, a fresh `CacheEngine`,
`set_forward_context`, `model(input_ids, positions)`), so what is trained is exactly
what inference computes. With gradients enabled the forward is differentiable; the
caches a step binds are dropped with the next step's.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.config import Config
from atom.model_engine.batch import SeqWork
from atom.model_engine.cache_engine import CacheEngine
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_loader.build import load_target
from atom.utils.arithmetic import ceil_div
from atom.utils.forward_context import ForwardContext, set_forward_context

BLOCK_SIZE = 16


def pick_device(choice: str = "auto") -> torch.device:
    """`auto`: CUDA when present, else CPU."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def load_model(
    model: str, device: torch.device | str = "cpu"
) -> tuple[nn.Module, Config]:
    """A target (tiny name or folder) built on `device` in float32, weights loaded,
    every parameter frozen (training unfreezes what it trains)."""
    device = torch.device(device)
    config = Config(model=model, device=device.type, dtype="float32")
    network, _ = load_target(config, device)
    return network, config


def prefill(
    model: nn.Module,
    sequences: list[list[int]],
    kv_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Final hidden states [sum of lengths, H] of `sequences`, each from position 0,
    rows in sequence order (differentiable unless called under no_grad).
    `kv_dtype`: the paged KV rows' dtype (`--kv-cache-dtype`); None: the model's."""
    if not sequences or any(len(seq) == 0 for seq in sequences):
        raise ValueError("prefill needs at least one sequence, none of them empty")
    parameter = next(model.parameters())
    blocks = ceil_div(max(len(seq) for seq in sequences), BLOCK_SIZE)
    count = len(sequences)
    CacheEngine(
        [model],
        blocks * count,
        BLOCK_SIZE,
        count,
        0,
        parameter.device,
        parameter.dtype,
        kv_dtype,
    )
    works = [
        SeqWork(
            seq_id=i,
            token_ids=list(seq),
            context_len=0,
            block_table=list(range(i * blocks, (i + 1) * blocks)),
            state_slot=i,
        )
        for i, seq in enumerate(sequences)
    ]
    input_ids, positions, metadata = prepare_inputs(works, BLOCK_SIZE, parameter.device)
    with set_forward_context(ForwardContext(metadata)):
        return model(input_ids, positions)
