"""MiniMax-M3 / M3.1 target models under pipeline x tensor parallelism.

A stage builds only its layers (`make_layers`); the embedding exists where
`pp_holds_embedding` says (the first stage, and the last one when a DSpark drafter
there shares it), the final norm and the head on the last stage only. The forward
branches on the stage's position, never on which modules exist.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.config import Config
from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.model_ops.embed_head import VocabParallelEmbedding
from atom.model_ops.layernorm import GemmaRMSNorm
from atom.models.causal_lm import PipelineCausalLM, TextOnlyWrapper
from atom.models.minimax_m3.config import MiniMaxM3TextConfig
from atom.models.minimax_m3.layer import MiniMaxM3DecoderLayer
from atom.models.minimax_m3.names import map_text_checkpoint_name
from atom.models.utils import (
    IntermediateTensors,
    PPMissingLayer,
    make_layers,
    maybe_prefix,
    pp_holds_embedding,
)


class MiniMaxM3Model(nn.Module):
    pp_payload_keys = ("hidden_states", "residual")

    def __init__(self, config: Config, prefix: str = "") -> None:
        super().__init__()
        text = MiniMaxM3TextConfig.from_hf(
            config.hf_config.text, get_tp_group().world_size
        )
        self.text_config = text
        # Read by the DSpark draft's share_with_target on every stage, including
        # one whose embed_tokens is a PPMissingLayer.
        self.vocab_size = text.vocab_size
        self.hidden_size = text.hidden_size
        if pp_holds_embedding(config):
            self.embed_tokens = VocabParallelEmbedding(
                text.vocab_size, text.hidden_size
            )
        else:
            self.embed_tokens = PPMissingLayer()

        def build_layer(layer_prefix: str) -> MiniMaxM3DecoderLayer:
            index = int(layer_prefix.rsplit(".", 1)[1])
            return MiniMaxM3DecoderLayer(text, index, layer_prefix)

        self.start_layer, self.end_layer, self.layers = make_layers(
            text.num_hidden_layers,
            build_layer,
            maybe_prefix(prefix, "layers"),
            config.pp_layer_partition,
        )
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
            if intermediate_tensors is None:
                raise ValueError(
                    "a non-first pipeline stage needs intermediate_tensors"
                )
            missing = set(self.pp_payload_keys) - set(intermediate_tensors.keys())
            if missing:
                raise ValueError(f"pipeline payload lacks {sorted(missing)}")
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden, residual = layer(positions, hidden, residual)
        if not pp.is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        return self.norm(residual + hidden)


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
