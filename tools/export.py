"""Trained parameters back to checkpoint tensors, through the loader's own mapping.

A checkpoint tensor may land in part of a parameter (merged projections, fused
experts, TP shards, the first heads of a longer `A_log`). Rather than restating those
rules backwards, each tensor's destination is found by loading a probe: the tensor's
flat element indices, written by the parameter's own `weight_loader`. Every element
of the parameter that the probe wrote tells which checkpoint element it came from;
elements no parameter holds (stub vision tensors, spare `A_log` entries, the
draft's confidence head) keep the template's values.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_loader.loader import map_checkpoint_name
from atom.model_ops.linear import default_weight_loader

# Probes are float32 inside the parameters: integers are exact below 2**24.
MAX_PROBE_ELEMENTS = 1 << 24


def _destination(model: nn.Module, name: str) -> tuple[str, object] | None:
    if any(name.startswith(p) for p in getattr(model, "skip_weight_prefixes", ())):
        return None
    return map_checkpoint_name(model, name)


@torch.no_grad()
def export_checkpoint(
    model: nn.Module, template: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`template` (checkpoint name -> tensor) with the model's current values, CPU
    float32; raises if a loaded name maps to no parameter of the model."""
    params = dict(model.named_parameters())
    exported = {}
    for name, initial in template.items():
        value = initial.detach().float().cpu().clone()
        exported[name] = value
        destination = _destination(model, name)
        if destination is None:
            continue
        param_name, shard_id = destination
        if param_name not in params:
            raise ValueError(
                f"checkpoint tensor {name} maps to no parameter ({param_name})"
            )
        if value.numel() > MAX_PROBE_ELEMENTS:
            raise ValueError(f"{name} is too large to probe ({value.numel()} elements)")
        param = params[param_name]
        trained = param.detach().clone()
        probe = torch.arange(value.numel(), dtype=torch.float32).view(value.shape)
        param.fill_(-1.0)
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard_id is None:
            loader(param, probe.to(param.device))
        else:
            loader(param, probe.to(param.device), shard_id)
        written = param >= 0
        value.view(-1)[param[written].long().cpu()] = trained[written].float().cpu()
        param.copy_(trained)
    return exported
