"""Checkpoint tensor names -> (parameter name, shard id) for the Kimi text stack.

Names here are relative to the text model (`model.*`, `lm_head.*`); the K3 wrapper
strips and re-adds its `language_model.` prefix around this mapping. Folders written
by transformers' `save_pretrained` are accepted too (see hf_names.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from atom.models.kimi_k3.hf_names import to_checkpoint_names

# Per-expert tensors: `experts.{e}.w1` (gate), `.w3` (up), `.w2` (down), with or
# without a trailing `.weight`, load into the fused `experts.w13` / `experts.w2`.
# MXFP4 checkpoints (K3) store `.weight_packed` + `.weight_scale` instead.
_EXPERT = re.compile(
    r"^(?P<owner>.*\.experts)\.(?P<e>\d+)\.(?P<w>w[123])"
    r"(\.weight(_(?P<part>packed|scale))?)?$"
)
_LAYER = re.compile(r"^model\.layers\.(?P<i>\d+)\.")
# Dense MLP and shared experts pack gate and up into one column-parallel weight.
_GATE_UP = ((".gate_proj.", 0), (".up_proj.", 1))


class ExpertPart(NamedTuple):
    """Shard id of one half of an MXFP4 expert projection: (expert, "w1", "packed")."""

    expert: int
    projection: str
    part: str  # "packed" | "scale"

    def __str__(self) -> str:
        # The loader names absent shards with str(): show the checkpoint tensor.
        return f"experts.{self.expert}.{self.projection}.weight_{self.part}"


def map_text_checkpoint_name(name: str, num_layers: int) -> tuple[str, object] | None:
    """The parameter a text-stack tensor loads into, or None for tensors atom skips
    (rotary caches, MTP layers `layers.{>=L}`)."""
    if "rotary_emb." in name:
        return None
    name = checkpoint_spelling(name)
    layer = _LAYER.match(name)
    if layer and int(layer["i"]) >= num_layers:
        return None
    expert = _EXPERT.match(name)
    if expert:
        fused = f"{expert['owner']}.{'w2' if expert['w'] == 'w2' else 'w13'}"
        if expert["part"]:
            return fused, ExpertPart(int(expert["e"]), expert["w"], expert["part"])
        return fused, (int(expert["e"]), expert["w"])
    for part, shard in _GATE_UP:
        if part in name:
            return name.replace(part, ".gate_up_proj."), shard
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
