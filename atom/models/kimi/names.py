"""Checkpoint tensor names -> (parameter name, shard id) for the Kimi text stack.

Names here are relative to the text model (`model.*`, `lm_head.*`); the K3 wrapper
strips and re-adds its `language_model.` prefix around this mapping. Folders written
by transformers' `save_pretrained` are accepted too (see hf_names.py).
"""

from __future__ import annotations

import re

import torch

from atom.model_ops.gated_mlp import GATE_UP_SHARDS
from atom.model_ops.routed_experts import expert_checkpoint_target
from atom.models.kimi.config import KimiTextConfig
from atom.models.kimi.hf_names import to_checkpoint_names
from atom.models.kimi.kda import KDA_IN_PROJ_SHARDS

_LAYER = re.compile(r"^model\.layers\.(?P<i>\d+)\.")


def map_text_checkpoint_name(
    name: str, config: KimiTextConfig
) -> tuple[str, object] | None:
    """The parameter a text-stack tensor loads into, or None for tensors atom skips
    (rotary caches, MTP layers `layers.{>=L}`)."""
    if "rotary_emb." in name:
        return None
    name = checkpoint_spelling(name)
    layer = _LAYER.match(name)
    if layer and int(layer["i"]) >= config.num_hidden_layers:
        return None
    expert = expert_checkpoint_target(name)
    if expert is not None:
        return expert
    for part, shard in GATE_UP_SHARDS:
        if f".{part}." in name:
            return name.replace(f".{part}.", ".gate_up_proj."), shard
    # A KDA layer multiplies q, k, v and the gates' low-rank halves as one merged
    # projection (an MLA layer's q_proj stays its own).
    if layer and config.is_kda_layer(int(layer["i"])):
        for part, shard in KDA_IN_PROJ_SHARDS:
            if f".self_attn.{part}." in name:
                return name.replace(f".{part}.", ".in_proj."), shard
    return name, None


def checkpoint_spelling(name: str) -> str:
    """The published checkpoint name of a (possibly transformers-saved) tensor name."""
    # hf_names maps state dicts; a placeholder tensor lets it rename a single name.
    renamed = list(to_checkpoint_names({name: torch.empty(0)}))
    if len(renamed) != 1:
        raise ValueError(
            f"{name!r} is a fused transformers tensor; load a save_pretrained folder"
        )
    return renamed[0]
