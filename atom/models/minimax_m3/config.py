"""The MiniMax-M3 text config in both dialects, read into one layer plan.

The released config.json nests the sparse attention settings in
`sparse_attention_config` (`sparse_attention_freq`, `sparse_num_index_heads`, ...)
and lists FFN kinds in `moe_layer_freq`. transformers (>= 5.23) rewrites it on load
into flat `layer_types` / `mlp_layer_types` / `index_*` fields, sets `hidden_act`
to "silu" and moves `rope_theta` / `partial_rotary_factor` into `rope_parameters`,
and `save_pretrained` writes that dialect back. A reader of only one dialect sees a
dense model (or refuses "silu"), so both are read here, cross-checked where both
appear, and every layer is typed once: sparse or full attention, MoE or dense FFN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from atom.model_ops.block_sparse import IndexerConfig

SPARSE_LAYER_TYPE, FULL_LAYER_TYPE = "minimax_m3_sparse", "full_attention"
MOE_MLP_TYPE, DENSE_MLP_TYPE = "sparse", "dense"
# Flat (transformers) index field -> key inside the released sparse_attention_config.
INDEX_FIELDS = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}
# The MiniMax FFN is always swigluoai; transformers' dialect names it "silu".
ACCEPTED_HIDDEN_ACTS = ("swigluoai", "silu")


@dataclass(frozen=True)
class LayerKindField:
    """Where a config says which kind each layer is: the released per-layer flags
    or transformers' flat list of `on` / `off` entries."""

    what: str
    released: str
    flat: str
    on: str
    off: str


ATTENTION_KIND_FIELD = LayerKindField(
    "attention",
    "sparse_attention_config.sparse_attention_freq",
    "layer_types",
    SPARSE_LAYER_TYPE,
    FULL_LAYER_TYPE,
)
FFN_KIND_FIELD = LayerKindField(
    "FFN", "moe_layer_freq", "mlp_layer_types", MOE_MLP_TYPE, DENSE_MLP_TYPE
)


@dataclass(frozen=True)
class MiniMaxLayer:
    index: int
    sparse_attention: bool
    moe: bool


@dataclass(frozen=True)
class MiniMaxM3TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    swiglu_alpha: float
    swiglu_limit: float
    dense_intermediate_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int  # all shared experts together; 0: none
    num_experts: int
    num_experts_per_token: int
    routed_scaling_factor: float
    indexer: IndexerConfig | None
    layers: tuple[MiniMaxLayer, ...]

    @classmethod
    def from_hf(cls, text: Mapping[str, Any], tp_size: int = 1) -> MiniMaxM3TextConfig:
        """Normalise a MiniMax-M3 text config of either dialect."""
        _refuse_unsupported(text)
        num_layers = int(_require(text, "num_hidden_layers"))
        sparse_cfg = text.get("sparse_attention_config") or {}
        layers = tuple(
            MiniMaxLayer(i, sparse, moe)
            for i, (sparse, moe) in enumerate(
                zip(
                    _attention_kinds(text, sparse_cfg, num_layers),
                    _ffn_kinds(text, num_layers),
                )
            )
        )
        heads = int(_require(text, "num_attention_heads"))
        hidden = int(_require(text, "hidden_size"))
        head_dim = int(text.get("head_dim") or hidden // heads)
        num_experts = _one_of(text, ("num_local_experts", "num_experts"))
        config = cls(
            vocab_size=int(_require(text, "vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(_require(text, "num_key_value_heads")),
            head_dim=head_dim,
            rotary_dim=_rotary_dim(text, head_dim),
            rope_theta=float(_rope_field(text, "rope_theta")),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            swiglu_alpha=float(_require(text, "swiglu_alpha")),
            swiglu_limit=float(_require(text, "swiglu_limit")),
            dense_intermediate_size=int(text.get("dense_intermediate_size") or 0),
            moe_intermediate_size=int(text.get("intermediate_size") or 0),
            shared_intermediate_size=_shared_width(text),
            num_experts=int(num_experts or 0),
            num_experts_per_token=int(text.get("num_experts_per_tok") or 0),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
            indexer=_indexer(
                text, sparse_cfg, any(layer.sparse_attention for layer in layers)
            ),
            layers=layers,
        )
        config.validate(tp_size)
        return config

    def validate(self, tp_size: int) -> None:
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim="
                f"{self.head_dim}]"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if any(layer.moe for layer in self.layers):
            if self.num_experts < 1 or self.num_experts_per_token < 1:
                raise ValueError(
                    "MoE layers need num_local_experts and num_experts_per_tok >= 1, "
                    f"got {self.num_experts} and {self.num_experts_per_token}"
                )
        if not all(layer.moe for layer in self.layers) and not (
            self.dense_intermediate_size
        ):
            raise ValueError("dense layers need dense_intermediate_size")
        indexer = self.indexer
        if indexer is not None:
            if indexer.num_heads != self.num_key_value_heads:
                raise ValueError(
                    f"sparse_num_index_heads / index_n_heads={indexer.num_heads} must "
                    f"equal num_key_value_heads={self.num_key_value_heads}: index head "
                    "g selects the blocks of KV group g"
                )
            if indexer.head_dim < self.rotary_dim:
                raise ValueError(
                    f"index head dim {indexer.head_dim} is smaller than rotary_dim="
                    f"{self.rotary_dim}"
                )
            if min(indexer.block_size, indexer.topk_blocks, indexer.local_blocks) < 1:
                raise ValueError(
                    f"indexer block size, top-k blocks and local blocks must be >= 1, "
                    f"got {indexer}"
                )
        self._validate_tp(tp_size)

    def _validate_tp(self, tp: int) -> None:
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide num_key_value_heads={kv} or "
                "be a multiple of it (KV heads are then replicated)"
            )
        split = {
            "num_attention_heads": self.num_attention_heads,
            "vocab_size": self.vocab_size,
            "dense_intermediate_size": self.dense_intermediate_size,
            "intermediate_size (per expert)": self.moe_intermediate_size,
            "shared_intermediate_size x n_shared_experts": (
                self.shared_intermediate_size
            ),
        }
        for name, value in split.items():
            if value % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide {name}={value}"
                )


def _require(fields: Mapping[str, Any], name: str, where: str = "config") -> Any:
    if fields.get(name) is None:
        raise ValueError(f"{where} is missing the required field {name!r}")
    return fields[name]


def _one_of(fields: Mapping[str, Any], names: Sequence[str]) -> Any:
    """The value of whichever spelling is set; both set must agree."""
    values = {name: fields[name] for name in names if fields.get(name) is not None}
    if len(set(values.values())) > 1:
        raise ValueError(f"config sets {values}, which disagree")
    return next(iter(values.values()), None)


def _refuse_unsupported(text: Mapping[str, Any]) -> None:
    act = str(text.get("hidden_act", "swigluoai")).lower()
    if act not in ACCEPTED_HIDDEN_ACTS:
        raise ValueError(
            f"hidden_act {act!r}: MiniMax-M3 experts are swigluoai (transformers "
            f"writes 'silu'); allowed: {', '.join(ACCEPTED_HIDDEN_ACTS)}"
        )
    unsupported = {
        "use_gemma_norm": (False, "plain RMSNorm"),
        "use_qk_norm": (False, "attention without QK norm"),
        "attention_output_gate": (True, "an attention output gate"),
        "tie_word_embeddings": (True, "tied embeddings"),
        "use_routing_bias": (False, "routing without the correction bias"),
        "use_index_cache": (True, "reusing an earlier layer's block selection"),
    }
    for field, (bad, what) in unsupported.items():
        if text.get(field) is bad:
            raise ValueError(f"{field}: {bad} ({what}) is not supported")
    norm_type = text.get("qk_norm_type", "per_head")
    if norm_type != "per_head":
        raise ValueError(f"qk_norm_type {norm_type!r} is not supported (per_head)")
    scoring = text.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"scoring_func {scoring!r} is not supported (sigmoid)")
    rope_type = (text.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (default)")


def _per_layer(values: Any, name: str, num_layers: int) -> list | tuple:
    if not isinstance(values, list | tuple) or len(values) != num_layers:
        raise ValueError(
            f"{name} must list one entry per layer ({num_layers}), got {values!r}"
        )
    return values


def _flags(values: Any, name: str, num_layers: int) -> list[bool]:
    return [bool(v) for v in _per_layer(values, name, num_layers)]


def _kinds(values: Any, name: str, num_layers: int, on: str, off: str) -> list[bool]:
    values = _per_layer(values, name, num_layers)
    bad = sorted({v for v in values if v not in (on, off)})
    if bad:
        raise ValueError(f"{name} holds {bad}; allowed: {on!r}, {off!r}")
    return [v == on for v in values]


def _agreeing(
    released: list[bool] | None, flat: list[bool] | None, names: str
) -> list[bool] | None:
    if released is not None and flat is not None and released != flat:
        raise ValueError(f"{names} disagree: {released} vs {flat}")
    return released if released is not None else flat


def _released_or_flat(
    text: Mapping[str, Any],
    released: list[bool] | None,
    field: LayerKindField,
    num_layers: int,
) -> list[bool]:
    """Per-layer kinds from the released flags or transformers' flat list (both
    set: they must agree); one of them is required."""
    flat = None
    if text.get(field.flat) is not None:
        flat = _kinds(text[field.flat], field.flat, num_layers, field.on, field.off)
    kinds = _agreeing(released, flat, f"{field.released} and {field.flat}")
    if kinds is None:
        raise ValueError(
            f"config types no {field.what} layer: it needs {field.released} "
            f"(released) or {field.flat} (transformers)"
        )
    return kinds


def _attention_kinds(
    text: Mapping[str, Any], sparse_cfg: Mapping[str, Any], num_layers: int
) -> list[bool]:
    released = None
    if "sparse_attention_freq" in sparse_cfg:
        released = _flags(
            sparse_cfg["sparse_attention_freq"],
            "sparse_attention_config.sparse_attention_freq",
            num_layers,
        )
        if sparse_cfg.get("use_sparse_attention", True) is False:
            released = [False] * num_layers
        disabled = sparse_cfg.get("sparse_disable_index_value")
        if disabled is not None:
            disabled = _flags(
                disabled,
                "sparse_attention_config.sparse_disable_index_value",
                num_layers,
            )
            valued = [i for i, s in enumerate(released) if s and not disabled[i]]
            if valued:
                raise ValueError(
                    f"sparse layers {valued} enable the indexer's value branch "
                    "(sparse_disable_index_value 0), which is not supported"
                )
        score = sparse_cfg.get("sparse_score_type", "max")
        if score != "max":
            raise ValueError(f"sparse_score_type {score!r} is not supported (max)")
    return _released_or_flat(text, released, ATTENTION_KIND_FIELD, num_layers)


def _ffn_kinds(text: Mapping[str, Any], num_layers: int) -> list[bool]:
    released = None
    if text.get("moe_layer_freq") is not None:
        released = _flags(text["moe_layer_freq"], "moe_layer_freq", num_layers)
    return _released_or_flat(text, released, FFN_KIND_FIELD, num_layers)


def _rope_field(text: Mapping[str, Any], name: str) -> Any:
    nested = (text.get("rope_parameters") or {}).get(name)
    value = _one_of(
        {"top": text.get(name), "rope_parameters": nested}, ("top", "rope_parameters")
    )
    if value is None:
        raise ValueError(f"config is missing {name!r} (top level or rope_parameters)")
    return value


def _rotary_dim(text: Mapping[str, Any], head_dim: int) -> int:
    factor = (text.get("rope_parameters") or {}).get(
        "partial_rotary_factor", text.get("partial_rotary_factor")
    )
    from_factor = None if factor is None else round(head_dim * float(factor))
    explicit = text.get("rotary_dim")
    if explicit is not None and from_factor is not None and explicit != from_factor:
        raise ValueError(
            f"rotary_dim={explicit} disagrees with head_dim x partial_rotary_factor "
            f"= {from_factor}"
        )
    value = explicit if explicit is not None else from_factor
    return int(head_dim if value is None else value)


def _shared_width(text: Mapping[str, Any]) -> int:
    """shared_intermediate_size x n_shared_experts (the intermediate size when the
    shared width is not given)."""
    count = text.get("n_shared_experts")
    per_expert = text.get("shared_intermediate_size")
    if per_expert is None:
        per_expert = text.get("intermediate_size") if count else 0
    if count is None:
        count = 1 if per_expert else 0
    return int(per_expert or 0) * int(count)


def _indexer(
    text: Mapping[str, Any], sparse_cfg: Mapping[str, Any], needed: bool
) -> IndexerConfig | None:
    if not needed:
        return None
    values = {}
    for flat, released in INDEX_FIELDS.items():
        value = _one_of(
            {flat: text.get(flat), released: sparse_cfg.get(released)},
            (flat, released),
        )
        if value is None:
            raise ValueError(
                f"sparse layers need sparse_attention_config.{released} (or {flat})"
            )
        values[flat] = int(value)
    return IndexerConfig(
        num_heads=values["index_n_heads"],
        head_dim=values["index_head_dim"],
        block_size=values["index_block_size"],
        topk_blocks=values["index_topk_blocks"],
        local_blocks=values["index_local_blocks"],
        init_blocks=int(sparse_cfg.get("sparse_init_block", 0)),
    )
