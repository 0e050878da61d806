"""What a drafter hands back for one step: the drafts and the law they came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftOutput:
    """Drafts of the sampled sequences of one step, on the device, in batch order."""

    # [S, T] long.
    ids: torch.Tensor
    # [S, T, V] fp32: the exact distribution each draft was drawn from (one-hot of
    # the draft for greedy requests), which lossless verification needs; None when
    # every request is greedy.
    probs: torch.Tensor | None

    @property
    def num_drafts(self) -> int:
        return self.ids.shape[1]
