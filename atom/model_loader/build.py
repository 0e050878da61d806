"""Build models on a chosen device in a chosen dtype, then load them strictly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from atom.config import Config
from atom.model_loader.loader import LoadReport, load_weights
from atom.model_ops.quantization.apply import prepare_quantization
from atom.models.interfaces import PipelineModel
from atom.models.registry import get_model_class


@contextmanager
def building_on(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside get their parameters on `device` in `dtype` (a layer
    may still ask for fp32); the previous default dtype comes back afterwards."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(saved)


def load_target(
    config: Config, device: torch.device | str
) -> tuple[nn.Module, LoadReport]:
    """The registry's class for the checkpoint, built on `device` in the config's
    dtype, quantized as the config says, its weights loaded strictly, in eval mode."""
    with building_on(device, config.torch_dtype):
        model = get_model_class(config.hf_config.architecture)(config)
    if not isinstance(model, PipelineModel):
        raise TypeError(
            f"{type(model).__name__} lacks what a target declares "
            "(PipelineModel, atom/models/interfaces.py)"
        )
    prepare_quantization(model, config.quantization)
    report = load_weights(model, config.model)
    return model.eval(), report
