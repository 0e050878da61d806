"""MiniMax-M3 / M3.1 target models under pipeline x tensor parallelism.

A stage builds only its layers (`make_layers`); the embedding exists where
`pp_holds_embedding` says (the first stage, and the last one when a DSpark drafter
there shares it), the final norm and the head on the last stage only. The forward
branches on the stage's position, never on which modules exist.
"""

from __future__ import annotations

from functools import partial

import torch

from atom.config import Config
from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.model_ops.layernorm import GemmaRMSNorm
from atom.models.causal_lm import (
    PipelineCausalLM,
    PipelineTextStack,
    TextOnlyWrapper,
)
from atom.models.minimax_m3.config import MiniMaxM3TextConfig
from atom.models.minimax_m3.layer import MiniMaxM3DecoderLayer
from atom.models.minimax_m3.names import map_text_checkpoint_name
from atom.models.utils import IntermediateTensors, PPMissingLayer


class MiniMaxM3Model(PipelineTextStack):
    pp_payload_keys = ("hidden_states", "residual")

    def __init__(self, config: Config, prefix: str = "") -> None:
        super().__init__()
        text = MiniMaxM3TextConfig.from_hf(
            config.hf_config.text, get_tp_group().world_size
        )
        layer_class = partial(
            MiniMaxM3DecoderLayer, attention_backend=config.attention_backend
        )
        self.build_stage(config, text, layer_class, prefix)
        if get_pp_group().is_last_rank:
            self.norm = GemmaRMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        else:
            self.norm = PPMissingLayer()

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device | str
    ) -> IntermediateTensors:
        shape = (num_tokens, self.hidden_size)
        return IntermediateTensors(
            {
                key: torch.zeros(shape, dtype=dtype, device=device)
                for key in self.pp_payload_keys
            }
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        pp = get_pp_group()
        if pp.is_first_rank:
            # A module call: the DSpark tap hook for -1 sits on embed_tokens.
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            payload = self.received_payload(intermediate_tensors)
            hidden, residual = payload["hidden_states"], payload["residual"]
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden, residual = layer(positions, hidden, residual)
        if not pp.is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        return self.norm.add_and_norm(hidden, residual)[0]


class MiniMaxM3SparseForCausalLM(PipelineCausalLM):
    """The MiniMax-M3 text stack `model.*` plus the untied head `lm_head.*`."""

    model_class = MiniMaxM3Model

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        return map_text_checkpoint_name(name, self.model.text_config)


class MiniMaxM3SparseForConditionalGeneration(TextOnlyWrapper):
    """MiniMax-M3 (and M3.1 via ARCH_ALIASES) served text-only: the text model under
    `language_model.`; the vision tower and projectors are neither built nor loaded."""

    text_model_class = MiniMaxM3SparseForCausalLM
    skip_weight_prefixes = (
        "vision_tower.",
        "multi_modal_projector.",
        "patch_merge_mlp.",
    )
