"""Which class serves which checkpoint architecture, and what it supports under PP.

Classes are named by import path and loaded lazily: reading the tables imports no model.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from atom.models.kimi.dspark_config import DEFAULT_DRAFT_ARCHITECTURE

if TYPE_CHECKING:
    from torch import nn

    from atom.config import Config

# Later releases that reuse an existing implementation unchanged.
ARCH_ALIASES: dict[str, str] = {
    "KimiK31ForConditionalGeneration": "KimiK3ForConditionalGeneration",
    # MiniMax-M3.1 is served as a drop-in for M3; no distinct config is public.
    "MiniMaxM31SparseForConditionalGeneration": (
        "MiniMaxM3SparseForConditionalGeneration"
    ),
    "MiniMaxM31SparseForCausalLM": "MiniMaxM3SparseForCausalLM",
}

_KIMI = "atom.models.kimi.model"
_MINIMAX = "atom.models.minimax_m3.model"

TARGET_MODELS: dict[str, str] = {
    "KimiLinearForCausalLM": f"{_KIMI}:KimiLinearForCausalLM",
    "KimiK3ForCausalLM": f"{_KIMI}:KimiK3ForCausalLM",
    "KimiK3ForConditionalGeneration": f"{_KIMI}:KimiK3ForConditionalGeneration",
    "MiniMaxM3SparseForCausalLM": f"{_MINIMAX}:MiniMaxM3SparseForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration": (
        f"{_MINIMAX}:MiniMaxM3SparseForConditionalGeneration"
    ),
}

DRAFT_MODELS: dict[str, str] = {
    "K3DSparkModel": "atom.models.kimi.dspark:KimiK3DSpark",
    "Qwen3DSparkModel": "atom.models.qwen3_dspark.model:Qwen3DSpark",
}

# Whether each speculative method's draft shares the target's embedding. Only sharing
# methods may be declared for PP: their drafter on the last stage needs the target's
# table there, which `pp_holds_embedding` builds.
METHOD_SHARES_EMBEDDING: dict[str, bool] = {"dspark": True}

# Speculative methods each architecture serves under pipeline parallelism.
pp_speculative_methods: dict[str, frozenset[str]] = {
    "KimiK3ForConditionalGeneration": frozenset({"dspark"}),
    "KimiK3ForCausalLM": frozenset({"dspark"}),
    "KimiLinearForCausalLM": frozenset({"dspark"}),
    "MiniMaxM3SparseForConditionalGeneration": frozenset({"dspark"}),
    "MiniMaxM3SparseForCausalLM": frozenset({"dspark"}),
}


def _check_declarations() -> None:
    for arch, methods in pp_speculative_methods.items():
        for method in methods:
            if not METHOD_SHARES_EMBEDDING.get(method, False):
                raise TypeError(
                    f"pp_speculative_methods[{arch!r}] declares {method!r}, whose draft "
                    "keeps its own embedding; only embedding-sharing methods may be "
                    "declared"
                )


_check_declarations()


def resolve_architecture(arch: str) -> str:
    return ARCH_ALIASES.get(arch, arch)


def _load(table: dict[str, str], arch: str, kind: str) -> type[nn.Module]:
    canonical = resolve_architecture(arch)
    if canonical not in table:
        supported = sorted(
            set(table) | {a for a, c in ARCH_ALIASES.items() if c in table}
        )
        raise ValueError(
            f"unknown {kind} architecture {arch!r}; supported: {', '.join(supported)}"
        )
    module_name, class_name = table[canonical].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def get_model_class(arch: str) -> type[nn.Module]:
    return _load(TARGET_MODELS, arch, "model")


def get_draft_model_class(arch: str) -> type[nn.Module]:
    return _load(DRAFT_MODELS, arch, "draft model")


def draft_architecture(draft_config: Mapping[str, Any]) -> str:
    """The draft checkpoint's architecture (Kimi-K3 DSpark exports may omit it)."""
    archs = draft_config.get("architectures") or []
    return archs[0] if archs else DEFAULT_DRAFT_ARCHITECTURE


def draft_tap_ids(draft_config: Mapping[str, Any]) -> list[int]:
    """The target layers a draft taps, read and validated by its own config class.

    Every stage needs them for the tap relay; only the last stage builds the draft.
    """
    draft_cls = get_draft_model_class(draft_architecture(draft_config))
    return list(draft_cls.config_class.from_hf(draft_config).target_layer_ids)


def serves_pp_speculation(config: Config) -> bool:
    """Speculation is on and its method is declared for this architecture under PP."""
    spec = config.speculative_config
    if spec is None:
        return False
    arch = resolve_architecture(config.hf_config.architecture)
    return spec.method in pp_speculative_methods.get(arch, frozenset())


def check_pp_support(config: Config) -> None:
    """Refuse what the engine cannot run under pipeline parallelism."""
    if config.pipeline_parallel_size == 1:
        return
    spec = config.speculative_config
    if spec is not None and not serves_pp_speculation(config):
        arch = config.hf_config.architecture
        declared = sorted(pp_speculative_methods.get(resolve_architecture(arch), ()))
        raise ValueError(
            f"speculative method {spec.method!r} is not supported under "
            f"pipeline parallelism for {arch}: pp_speculative_methods declares "
            f"{declared or 'none'} for it"
        )
