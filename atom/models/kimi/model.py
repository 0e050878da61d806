"""Kimi Linear / Kimi-K3 / K3.1 target models under pipeline x tensor parallelism.

A stage builds only its layers (`make_layers`); the embedding exists where
`pp_holds_embedding` says, the final norm / mix and the head on the last stage only.
The forward branches on the stage's position, never on which modules exist: the last
stage may hold an embedding copy for the DSpark drafter that the target never runs.
"""

from __future__ import annotations

from functools import partial

import torch

from atom.config import Config
from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.model_ops.attn_res import attn_res_mix_norm
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import ReplicatedLinear
from atom.model_ops.quantization.apply import declare_checkpoint_experts
from atom.models.causal_lm import (
    PipelineCausalLM,
    PipelineTextStack,
    TextOnlyWrapper,
)
from atom.models.kimi.config import KimiTextConfig
from atom.models.kimi.layer import KimiDecoderLayer
from atom.models.kimi.names import map_text_checkpoint_name
from atom.models.utils import IntermediateTensors, PPMissingLayer


def text_config_of(config: Config) -> KimiTextConfig:
    text = config.hf_config.text
    if text.get("tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings: true is not supported for Kimi targets")
    return KimiTextConfig.from_hf(text, get_tp_group().world_size)


class KimiLinearModel(PipelineTextStack):
    # Read as weights outside their forward (MLA absorption, KDA's fp32 beta, the
    # attention-residual mixes), so no quantization method may convert them.
    full_precision_linears = (
        "kv_b_proj",
        "b_proj",
        "self_attention_res_proj",
        "mlp_res_proj",
        "output_attn_res_proj",
    )

    def __init__(self, config: Config, prefix: str = "") -> None:
        super().__init__()
        text = text_config_of(config)
        self.attn_res = text.uses_attn_res
        layer_class = partial(
            KimiDecoderLayer,
            kda_backend=config.kda_backend,
            attention_backend=config.attention_backend,
        )
        self.build_stage(config, text, layer_class, prefix)
        # K3 declares its MXFP4 experts in `text_config.quantization_config`.
        declare_checkpoint_experts(self, config.quantization, prefix)
        last = get_pp_group().is_last_rank
        hidden, eps = text.hidden_size, text.rms_norm_eps
        self.norm = RMSNorm(hidden, eps=eps) if last else PPMissingLayer()
        if self.attn_res:
            self.output_attn_res_norm = (
                RMSNorm(hidden, eps=eps) if last else PPMissingLayer()
            )
            self.output_attn_res_proj = (
                ReplicatedLinear(hidden, 1) if last else PPMissingLayer()
            )
            self.pp_payload_keys = ("hidden_states", "block_residual")
        else:
            self.pp_payload_keys = ("hidden_states", "residual")

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device | str
    ) -> IntermediateTensors:
        """Receive buffers of this stage: the bank holds ceil(start/bs) blocks."""
        shape = (num_tokens, self.hidden_size)
        tensors = {"hidden_states": torch.zeros(shape, dtype=dtype, device=device)}
        if self.attn_res:
            blocks = self.text_config.blocks_before(self.start_layer)
            tensors["block_residual"] = torch.zeros(
                num_tokens, blocks, self.hidden_size, dtype=dtype, device=device
            )
        else:
            tensors["residual"] = torch.zeros(shape, dtype=dtype, device=device)
        return IntermediateTensors(tensors)

    def _stage_inputs(
        self,
        input_ids: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if get_pp_group().is_first_rank:
            # A module call: the DSpark tap hook for -1 sits on embed_tokens.
            hidden = self.embed_tokens(input_ids)
            if not self.attn_res:
                return hidden, None, None
            return hidden, None, hidden.new_zeros(hidden.shape[0], 0, hidden.shape[1])
        payload = self.received_payload(intermediate_tensors)
        hidden = payload["hidden_states"]
        if self.attn_res:
            return hidden, None, payload["block_residual"]
        return hidden, payload["residual"], None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        hidden, residual, bank = self._stage_inputs(input_ids, intermediate_tensors)
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden, residual, bank = layer(positions, hidden, residual, bank)
        if not get_pp_group().is_last_rank:
            if self.attn_res:
                # Fold the pending FFN output in, so the payload is self-contained.
                return IntermediateTensors(
                    {"hidden_states": residual + hidden, "block_residual": bank}
                )
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        stream = residual + hidden
        if not self.attn_res:
            return self.norm(stream)
        return attn_res_mix_norm(
            bank,
            stream,
            self.output_attn_res_norm.weight,
            self.output_attn_res_proj.weight,
            self.text_config.rms_norm_eps,
            self.norm,
        )


class KimiLinearForCausalLM(PipelineCausalLM):
    """The text stack `model.*` plus the untied head `lm_head.*`."""

    model_class = KimiLinearModel

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        return map_text_checkpoint_name(name, self.model.text_config)


class KimiK3ForCausalLM(KimiLinearForCausalLM):
    """The K3 text stack without a vision tower; same code, K3 features from config."""


class KimiK3ForConditionalGeneration(TextOnlyWrapper):
    """Kimi-K3 (and K3.1 via ARCH_ALIASES): the text model under `language_model.`;
    the vision tower and projector are not built and their tensors are skipped."""

    text_model_class = KimiK3ForCausalLM
    skip_weight_prefixes = ("vision_tower.", "mm_projector.")
