"""Vocabulary-parallel embedding and LM head: each TP rank holds V/tp rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.distributed.parallel_state import get_tp_group
from atom.model_ops.dense_product import dense_linear
from atom.model_ops.linear import default_weight_loader, divide, shard_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows_per_rank = divide(num_embeddings, self.tp_size, "vocab_size")
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"shape mismatch: checkpoint tensor {tuple(loaded.shape)} vs vocabulary "
                f"{self.num_embeddings} x {self.embedding_dim}"
            )
        default_weight_loader(param, shard_of(loaded, 0, self.tp_rank, self.tp_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return get_tp_group().all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary on every TP rank (local slice, then gather)."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = dense_linear(hidden_states, self.weight)
        return get_tp_group().all_gather(logits, dim=-1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)
