"""A small real target for the tap, relay and drafter tests.

Decoder layers hand their output back unapplied, like Kimi-K3's, so the tap
(`aux_hidden_state`) differs from the raw layer output. Weights are seeded per
layer, so a stage built for [start, end) holds exactly the single-stage weights.
Every stage holds a real `embed_tokens` (as a last stage that serves a drafter
does); the forward branches on the stage's position, never on module presence.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.embed_head import ParallelLMHead, VocabParallelEmbedding
from atom.models.utils import PPMissingLayer


def _seeded(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(shape, generator=gen) * scale, requires_grad=False)


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, index: int) -> None:
        super().__init__()
        self.weight = _seeded((hidden, hidden), 1000 + index, hidden**-0.5)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(hidden @ self.weight.t()), hidden

    def aux_hidden_state(self, output: tuple[torch.Tensor, torch.Tensor]):
        update, residual = output
        return residual + update


class ToyBaseModel(nn.Module):
    def __init__(
        self,
        num_layers: int = 8,
        hidden: int = 16,
        vocab: int = 64,
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.start_layer, self.end_layer = layer_range or (0, num_layers)
        self.vocab_size = vocab
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden)
        self.embed_tokens.weight = _seeded((vocab, hidden), 7)
        self.layers = nn.ModuleList(
            (
                ToyLayer(hidden, i)
                if self.start_layer <= i < self.end_layer
                else PPMissingLayer()
            )
            for i in range(num_layers)
        )

    def forward(
        self, input_ids: torch.Tensor | None, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.start_layer == 0:
            hidden = self.embed_tokens(input_ids)
        for layer in self.layers[self.start_layer : self.end_layer]:
            update, residual = layer(hidden)
            hidden = residual + update
        return hidden


class ToyCausalLM(nn.Module):
    """`.model` (layers, embed_tokens, vocab_size) and a real `.lm_head`."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.model = ToyBaseModel(**kwargs)
        vocab, hidden = self.model.embed_tokens.weight.shape
        self.lm_head = ParallelLMHead(vocab, hidden)
        self.lm_head.weight = _seeded((vocab, hidden), 8, hidden**-0.5)
