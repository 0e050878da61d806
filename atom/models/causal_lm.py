"""The text stack base and the two shells every target model here shares around it.

`PipelineTextStack`: what every text stack builds the same way, this stage's
embedding and decoder layers, and the check of what the previous stage sent.
`PipelineCausalLM`: the stack `model.*` plus the untied vocab-parallel head
`lm_head.*`, which exists on the last pipeline stage only. `TextOnlyWrapper`: a
multimodal checkpoint served text-only; the causal LM lives under `language_model.`
and the vision tensors are declared skipped, never built.

The stack (`model_class`) exposes `vocab_size`, `hidden_size`, `pp_payload_keys`
and `make_empty_intermediate_tensors`; subclasses map checkpoint names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from atom.config import Config
from atom.distributed.parallel_state import get_pp_group
from atom.model_ops.embed_head import ParallelLMHead, VocabParallelEmbedding
from atom.models.utils import (
    IntermediateTensors,
    PPMissingLayer,
    make_layers,
    maybe_prefix,
    pp_holds_embedding,
)


class PipelineTextStack(nn.Module):
    """Base of a text stack `model.*`; subclasses set `pp_payload_keys`."""

    pp_payload_keys: tuple[str, ...]

    def build_stage(
        self,
        config: Config,
        text: Any,
        layer_class: Callable[[Any, int, str], nn.Module],
        prefix: str,
    ) -> None:
        """The embedding where `pp_holds_embedding` says, and the decoder layers
        `layer_class(text, index, prefix)` this stage owns."""
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

        def build_layer(layer_prefix: str) -> nn.Module:
            index = int(layer_prefix.rsplit(".", 1)[1])
            return layer_class(text, index, layer_prefix)

        self.start_layer, self.end_layer, self.layers = make_layers(
            text.num_hidden_layers,
            build_layer,
            maybe_prefix(prefix, "layers"),
            config.pp_layer_partition,
        )

    def received_payload(
        self, intermediate_tensors: IntermediateTensors | None
    ) -> IntermediateTensors:
        """What the previous stage sent, checked to hold every payload key."""
        if intermediate_tensors is None:
            raise ValueError("a non-first pipeline stage needs intermediate_tensors")
        missing = set(self.pp_payload_keys) - set(intermediate_tensors.keys())
        if missing:
            raise ValueError(f"pipeline payload lacks {sorted(missing)}")
        return intermediate_tensors


class PipelineCausalLM(nn.Module):
    model_class: type[nn.Module]

    def __init__(self, config: Config, prefix: str = "") -> None:
        super().__init__()
        self.model = self.model_class(config, maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(self.model.vocab_size, self.model.hidden_size)
        else:
            self.lm_head = PPMissingLayer()
        self.pp_payload_keys = self.model.pp_payload_keys

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, V] over the full vocabulary (last stage; the final norm ran already)."""
        if not get_pp_group().is_last_rank:
            raise RuntimeError("compute_logits runs on the last pipeline stage only")
        return self.lm_head.compute_logits(hidden_states)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device | str
    ) -> IntermediateTensors:
        return self.model.make_empty_intermediate_tensors(num_tokens, dtype, device)

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        raise NotImplementedError


class TextOnlyWrapper(nn.Module):
    text_model_class: type[PipelineCausalLM]
    # Vision tower / projector tensors: declared skipped, never built.
    skip_weight_prefixes: tuple[str, ...] = ()
    _TEXT = "language_model."

    def __init__(self, config: Config, prefix: str = "") -> None:
        super().__init__()
        self.language_model = self.text_model_class(
            config, maybe_prefix(prefix, "language_model")
        )
        self.pp_payload_keys = self.language_model.pp_payload_keys

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.language_model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device | str
    ) -> IntermediateTensors:
        return self.language_model.make_empty_intermediate_tensors(
            num_tokens, dtype, device
        )

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        # vLLM spells the layers `language_model.layers.`; accept both forms.
        if name.startswith(self._TEXT + "layers."):
            name = self._TEXT + "model." + name[len(self._TEXT) :]
        if not name.startswith(self._TEXT):
            return name, None
        mapped = self.language_model.map_checkpoint_name(name[len(self._TEXT) :])
        if mapped is None:
            return None
        return self._TEXT + mapped[0], mapped[1]
