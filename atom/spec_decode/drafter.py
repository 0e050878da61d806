"""What every drafter is to the engine: a model on the last stage that sees each
target forward and proposes the next drafts of the step's sampled sequences.

`build_drafter` (factory.py) picks the class for the speculative method. Per step
the runner calls `precompute_context_kv` after every target forward, and the step
sampler calls `propose` once it has chosen the step's tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from atom.config import Config, is_context_only_producer
from atom.model_loader.loader import LoadReport
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.spec_decode.draft_output import DraftOutput


class Drafter(ABC):
    """Owns a draft model on one last-stage rank."""

    def __init__(self, config: Config) -> None:
        spec = config.speculative_config
        if spec is None or spec.draft_hf_config is None or not spec.model:
            raise ValueError(
                "the drafter needs a speculative_config with a draft model"
            )
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        # A P/D prefill node writes the draft's context for its decode node but
        # never drafts itself.
        self.will_propose = not is_context_only_producer(config)
        self.model: nn.Module | None = None
        self.load_report: LoadReport | None = None

    @abstractmethod
    def load_model(self, target: nn.Module) -> None:
        """Build and load the draft beside `target` (the full target model), under
        the caller's default device and dtype."""

    @abstractmethod
    def precompute_context_kv(
        self,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
        relayed_taps: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Write the draft's context for the N rows of the target forward just run
        (`relayed_taps`: hidden states earlier pipeline stages computed)."""

    @abstractmethod
    def propose(
        self,
        anchor_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        block_tables: torch.Tensor,
        sampling: SamplingMetadata,
    ) -> DraftOutput:
        """The next T drafts of each sampled sequence, on the device."""

    @abstractmethod
    def capture_graphs(self, sizes: list[int], table_width: int) -> None:
        """Capture the draft's per-step passes for these batch sizes as CUDA graphs
        (block tables `table_width` wide)."""
