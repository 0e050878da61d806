"""Checkpoint tensor names -> (parameter name, shard id) for the MiniMax-M3 stack.

Names are relative to the text model (`model.*`, `lm_head.*`); the multimodal
wrapper strips and re-adds `language_model.`. atom loads the released layout, which
transformers' `save_pretrained` also writes:

| checkpoint | parameter |
|---|---|
| `self_attn.{q,k,v,index_q,index_k}_proj.weight` | `self_attn.qkv_proj.weight`, shards 0-4 |
| `{mlp,shared_experts}.{gate,up}_proj.weight` | `*.gate_up_proj.weight`, shards 0, 1 |
| `block_sparse_moe.experts.{e}.w{1,3,2}.weight` | `experts.w13` / `experts.w2` |
| `block_sparse_moe.e_score_correction_bias` | `block_sparse_moe.gate.e_score_correction_bias` |

MTP modules (any name containing `.mtp.`) are skipped; atom serves no MTP.
"""

from __future__ import annotations

import re

from atom.model_ops.gated_mlp import GATE_UP_SHARDS
from atom.model_ops.routed_experts import expert_checkpoint_target
from atom.models.minimax_m3.attention import QKV_SHARDS
from atom.models.minimax_m3.config import MiniMaxM3TextConfig

_LAYER = re.compile(r"^model\.layers\.(?P<i>\d+)\.")
_QKV = re.compile(r"\.self_attn\.(?P<proj>(index_)?[qkv]_proj)\.weight$")
_BIAS = ".block_sparse_moe.e_score_correction_bias"


def map_text_checkpoint_name(
    name: str, config: MiniMaxM3TextConfig
) -> tuple[str, object] | None:
    """The parameter a text-stack tensor loads into, or None for MTP tensors."""
    if ".mtp." in name:
        return None
    expert = expert_checkpoint_target(name)
    if expert is not None:
        return expert
    if name.endswith(_BIAS):
        return (
            name.replace(_BIAS, ".block_sparse_moe.gate.e_score_correction_bias"),
            None,
        )
    qkv = _QKV.search(name)
    if qkv:
        proj = qkv["proj"]
        if proj.startswith("index_"):
            _check_sparse_layer(name, config)
        return name[: qkv.start()] + ".self_attn.qkv_proj.weight", QKV_SHARDS[proj]
    for part, shard in GATE_UP_SHARDS:
        if f".{part}." in name:
            return name.replace(f".{part}.", ".gate_up_proj."), shard
    return name, None


def _check_sparse_layer(name: str, config: MiniMaxM3TextConfig) -> None:
    layer = _LAYER.match(name)
    if layer is None or int(layer["i"]) >= config.num_hidden_layers:
        return
    if not config.layers[int(layer["i"])].sparse_attention:
        raise ValueError(
            f"checkpoint tensor {name!r} belongs to the lightning indexer, but the "
            f"config plans layer {layer['i']} as full attention; a config read in "
            "only one dialect (sparse_attention_config vs layer_types) looks dense"
        )
