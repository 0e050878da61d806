"""The K3DSparkModel draft config, read and validated.

Every width, the tap ids, the mask token and the Markov rank come from the draft's
config.json; nothing is hard-coded. A draft that does not fit its target (tap
geometry, vocabulary, hidden width, MLA latent width) is refused at start-up, because
a mismatched draft would still give correct output and only collapse acceptance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from atom.models.dspark_fields import check_matches_target, check_taps_and_mask

DEFAULT_DRAFT_ARCHITECTURE = "K3DSparkModel"


def _require(fields: Mapping[str, Any], name: str) -> Any:
    if fields.get(name) is None:
        raise ValueError(f"draft config is missing the required field {name!r}")
    return fields[name]


def _rope(fields: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(base, scaling) from `rope_parameters` (transformers 5) or legacy fields."""
    params = dict(fields.get("rope_parameters") or {})
    legacy = dict(fields.get("rope_scaling") or {})
    base = params.get("rope_theta", fields.get("rope_theta", 10000.0))
    scaling = params or legacy
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(base), (scaling if kind != "default" else None)


@dataclass(frozen=True)
class DSparkDraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    rms_norm_eps: float
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    target_num_hidden_layers: int
    mask_token_id: int
    markov_rank: int
    rope_theta: float
    rope_scaling: dict | None

    @property
    def kv_latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_hf(cls, fields: Mapping[str, Any]) -> DSparkDraftConfig:
        ints = {
            name: int(_require(fields, name))
            for name in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
                "vocab_size",
                "target_hidden_size",
                "target_num_hidden_layers",
                "mask_token_id",
                "markov_rank",
            )
        }
        base, scaling = _rope(fields)
        config = cls(
            **ints,
            rms_norm_eps=float(fields.get("rms_norm_eps", 1e-5)),
            target_layer_ids=tuple(_require(fields, "target_layer_ids")),
            rope_theta=base,
            rope_scaling=scaling,
        )
        config._validate(fields)
        return config

    def _validate(self, fields: Mapping[str, Any]) -> None:
        if fields.get("mla_use_nope"):
            raise ValueError(
                "K3DSparkModel drafts use RoPE; mla_use_nope must be false"
            )
        if fields.get("mla_use_output_gate"):
            raise ValueError(
                "K3DSparkModel drafts have no MLA output gate; "
                "mla_use_output_gate must be false"
            )
        kv_heads = fields.get("num_key_value_heads", self.num_attention_heads)
        if kv_heads != self.num_attention_heads:
            raise ValueError(
                f"MLA needs num_key_value_heads == num_attention_heads, got "
                f"{kv_heads} and {self.num_attention_heads}"
            )
        draft_vocab = fields.get("draft_vocab_size", self.vocab_size)
        if draft_vocab != self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {draft_vocab} != vocab_size {self.vocab_size}: "
                "reduced-vocabulary drafts (d2t maps) are not supported"
            )
        declared = fields.get("num_target_layers", self.num_taps)
        if declared != self.num_taps:
            raise ValueError(
                f"num_target_layers={declared} but target_layer_ids lists "
                f"{self.num_taps} taps {list(self.target_layer_ids)}"
            )
        check_taps_and_mask(
            self.target_layer_ids,
            self.target_num_hidden_layers,
            "target_num_hidden_layers",
            self.mask_token_id,
            self.vocab_size,
        )

    def validate_against_target(self, target: Mapping[str, Any]) -> None:
        """Refuse a draft whose geometry does not match the target text config."""
        checks = (
            ("target_hidden_size", self.target_hidden_size, "hidden_size"),
            (
                "target_num_hidden_layers",
                self.target_num_hidden_layers,
                "num_hidden_layers",
            ),
            ("vocab_size", self.vocab_size, "vocab_size"),
            # The draft embeds with the target table and scores with its LM head.
            ("hidden_size", self.hidden_size, "hidden_size"),
        )
        check_matches_target(checks, target)
        # Draft rows live in the target's MLA pool (same block tables, same width).
        target_latent = int(_require(target, "kv_lora_rank")) + int(
            _require(target, "qk_rope_head_dim")
        )
        if target_latent != self.kv_latent_dim:
            raise ValueError(
                f"draft MLA latent width {self.kv_latent_dim} (kv_lora_rank "
                f"{self.kv_lora_rank} + qk_rope_head_dim {self.qk_rope_head_dim}) "
                f"differs from the target's {target_latent}; the draft's KV rows must "
                "share the target's paged MLA pool"
            )
