"""The Qwen3DSparkModel draft config (MiniMax-M3's DSpark draft), read and validated.

The draft loads as a plain Qwen3 config whose DFlash / DSpark fields sit in a
`dspark_config` or `dflash_config` section (looked up in that order, then at the
top level). Two fields differ from the Kimi draft: `num_target_layers` is the
target's depth, not the tap count, and `sliding_window` may be nulled by Qwen3Config,
so the window comes from `swa_window_size`. Nothing is hard-coded; a draft that does
not fit its target is refused at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from atom.models.dspark_fields import check_matches_target, check_taps_and_mask

DRAFT_SECTIONS = ("dspark_config", "dflash_config")
_MISSING = object()


def draft_field(fields: Mapping[str, Any], name: str, default: Any = _MISSING) -> Any:
    """`name` from dspark_config, then dflash_config, then the top level."""
    for section in DRAFT_SECTIONS:
        value = (fields.get(section) or {}).get(name)
        if value is not None:
            return value
    if fields.get(name) is not None:
        return fields[name]
    if default is _MISSING:
        raise ValueError(
            f"draft config is missing {name!r} (looked in "
            f"{', '.join(DRAFT_SECTIONS)} and at the top level)"
        )
    return default


@dataclass(frozen=True)
class Qwen3DSparkConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    target_layer_ids: tuple[int, ...]
    target_num_hidden_layers: int
    block_size: int
    mask_token_id: int
    markov_rank: int
    # Context rows a block row at position a sees: a - window + 1 .. p. None: all.
    window: int | None

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def target_hidden_size(self) -> int:
        # The draft embeds with the target's table: the widths are one.
        return self.hidden_size

    @classmethod
    def from_hf(cls, fields: Mapping[str, Any]) -> Qwen3DSparkConfig:
        hidden = int(draft_field(fields, "hidden_size"))
        heads = int(draft_field(fields, "num_attention_heads"))
        window = None
        if draft_field(fields, "use_swa", False):
            fallback = fields.get("sliding_window") or 0
            window = int(draft_field(fields, "swa_window_size", fallback))
        rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
        config = cls(
            hidden_size=hidden,
            intermediate_size=int(draft_field(fields, "intermediate_size")),
            num_hidden_layers=int(draft_field(fields, "num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(draft_field(fields, "num_key_value_heads", heads)),
            head_dim=int(draft_field(fields, "head_dim", hidden // heads)),
            vocab_size=int(draft_field(fields, "vocab_size")),
            rms_norm_eps=float(draft_field(fields, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", fields.get("rope_theta", 1e6))),
            target_layer_ids=tuple(draft_field(fields, "target_layer_ids")),
            target_num_hidden_layers=int(draft_field(fields, "num_target_layers")),
            block_size=int(draft_field(fields, "block_size")),
            mask_token_id=int(draft_field(fields, "mask_token_id")),
            markov_rank=int(draft_field(fields, "markov_rank")),
            window=window,
        )
        config._validate(fields, rope)
        return config

    def _validate(self, fields: Mapping[str, Any], rope: Mapping[str, Any]) -> None:
        if draft_field(fields, "causal", False):
            raise ValueError(
                "causal: true block drafting is not supported; Qwen3DSparkModel "
                "drafts attend non-causally inside the block"
            )
        head = draft_field(fields, "markov_head_type", "vanilla")
        if head != "vanilla":
            raise ValueError(f"markov_head_type {head!r} is not supported (vanilla)")
        act = draft_field(fields, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (silu)")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"draft rope type {kind!r} is not supported (default)")
        if self.window is not None and self.window < 1:
            raise ValueError(
                "use_swa is set but no swa_window_size (or sliding_window) >= 1 is"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        check_taps_and_mask(
            self.target_layer_ids,
            self.target_num_hidden_layers,
            "num_target_layers, the target's depth",
            self.mask_token_id,
            self.vocab_size,
        )

    def validate_against_target(self, target: Mapping[str, Any]) -> None:
        """Refuse a draft whose geometry does not match the target text config."""
        checks = (
            ("hidden_size", self.hidden_size, "hidden_size"),
            ("vocab_size", self.vocab_size, "vocab_size"),
            ("num_target_layers", self.target_num_hidden_layers, "num_hidden_layers"),
        )
        check_matches_target(checks, target)
