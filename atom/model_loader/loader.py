"""Strict weight loading: every parameter is accounted for, or start-up stops.

After loading, each parameter must be loaded from the checkpoint or declared skipped
by its model. A parameter nothing wrote would run with garbage: for a draft that only
shows as collapsed acceptance, which is why this fails instead of warning. Checkpoint
tensors that map to no parameter fail too. A scale that online quantization computes
(`quantized_from`, `model_ops/quantization/`) is accounted for by the weight it is
computed from; once everything is accounted for, the weights are quantized. KV
cache scales are no parameters: they set their layers' `kv_scale` (`kv_scales.py`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn

from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.model_loader.kv_scales import KVScales, kv_scale_layer
from atom.model_loader.safetensors_io import iterate_tensors
from atom.model_ops.linear import default_weight_loader
from atom.model_ops.quantization.apply import finish_quantization
from atom.models.utils import is_pp_missing_parameter, missing_layer_prefixes


class WeightLoadingError(RuntimeError):
    pass


@dataclass
class LoadReport:
    stage: str
    loaded: set[str] = field(default_factory=set)
    skipped_declared: list[str] = field(default_factory=list)
    skipped_other_stage: int = 0


def stage_label() -> str:
    return f"pp_rank {get_pp_group().rank_in_group}, tp_rank {get_tp_group().rank_in_group}"


def map_checkpoint_name(model: nn.Module, name: str) -> tuple[str, object] | None:
    """(parameter name, shard id) for a checkpoint tensor, or None to skip it."""
    if hasattr(model, "map_checkpoint_name"):
        return model.map_checkpoint_name(name)
    for ckpt_part, (param_part, shard_id) in getattr(
        model, "packed_modules_mapping", {}
    ).items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), shard_id
    return name, None


def _declared_skip(model: nn.Module, name: str) -> bool:
    return any(name.startswith(p) for p in getattr(model, "skip_weight_prefixes", ()))


def load_weights(model: nn.Module, model_dir: str) -> LoadReport:
    """Load `model_dir` into `model` and account for every parameter."""
    report = LoadReport(stage_label())
    params = dict(model.named_parameters())
    missing_prefixes = missing_layer_prefixes(model)
    plan: dict[str, tuple[str, object]] = {}
    unknown: list[str] = []
    kv_scales = KVScales(model, map_checkpoint_name)
    scale_names: set[str] = set()

    def wanted(name: str) -> bool:
        layer = kv_scale_layer(name)
        if layer is not None:
            path = kv_scales.module_path(layer)
            if is_pp_missing_parameter(f"{path}.o_proj.weight", missing_prefixes):
                report.skipped_other_stage += 1
                return False
            scale_names.add(name)
            return True
        if _declared_skip(model, name):
            report.skipped_declared.append(name)
            return False
        target = map_checkpoint_name(model, name)
        if target is None:
            report.skipped_declared.append(name)
            return False
        if is_pp_missing_parameter(target[0], missing_prefixes):
            report.skipped_other_stage += 1
            return False
        if target[0] not in params:
            unknown.append(f"{name} (-> {target[0]})" if target[0] != name else name)
            return False
        plan[name] = target
        return True

    shards_loaded: dict[str, set] = defaultdict(set)
    for name, tensor in iterate_tensors(model_dir, wanted):
        if tensor is None:
            continue
        if name in scale_names:
            try:
                kv_scales.record(name, tensor)
            except ValueError as err:
                raise WeightLoadingError(f"[{report.stage}] {err}") from err
            continue
        param_name, shard_id = plan[name]
        param = params[param_name]
        loader = getattr(param, "weight_loader", None)
        try:
            if shard_id is None:
                (loader or default_weight_loader)(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as err:
            raise WeightLoadingError(
                f"[{report.stage}] cannot load checkpoint tensor {name!r} into "
                f"parameter {param_name!r}: {err}"
            ) from err
        shards_loaded[param_name].add(shard_id)

    problems = [f"checkpoint tensor with no parameter: {u}" for u in sorted(unknown)]
    problems += kv_scales.apply()
    computed: dict[str, str] = {}
    for param_name, param in params.items():
        if _declared_skip(model, param_name):
            continue
        source = getattr(param, "quantized_from", None)
        if source is not None:
            computed[param_name] = f"{param_name.rpartition('.')[0]}.{source}"
            continue
        expected = getattr(param, "expected_shards", {None})
        absent = set(expected) - shards_loaded.get(param_name, set())
        if absent:
            detail = "" if absent == {None} else f" (shards {sorted(map(str, absent))})"
            problems.append(f"parameter never loaded: {param_name}{detail}")
        else:
            report.loaded.add(param_name)
    for param_name, source in computed.items():
        if source in report.loaded:
            report.loaded.add(param_name)
        else:
            problems.append(f"{param_name} has no loaded {source} to quantize")
    if problems:
        raise WeightLoadingError(
            f"[{report.stage}] checkpoint {model_dir!r} does not account for the model:\n  "
            + "\n  ".join(problems)
        )
    finish_quantization(model)
    if hasattr(model, "post_load_weights"):
        model.post_load_weights()
    return report


def parameter_bytes(module: nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters())
