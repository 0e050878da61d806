"""Per-request logit adjustments: repetition, frequency and presence penalties,
logit_bias and the min_tokens ban, for a whole step's scored rows at once.

One function, `LogitAdjustments.apply`, adjusts the target's logits both in plain
sampling and in draft verification, before greedy argmax and before the
temperature / top-k / top-p filter. In verification, row j of a sequence predicts
the token after its first j drafts, and those drafts count as output there: row j
is only used when all of them are accepted, so its logits are exactly the ones
target-only decoding would see at that position, and speculation stays lossless.

Order, per row (history = the output before the predicted token):
1. repetition_penalty r on every id in the prompt or the history: a positive
   logit is divided by r, a negative one multiplied by r;
2. minus frequency_penalty x (count in the history), minus presence_penalty when
   the count is > 0 (OpenAI's definition: generated tokens only);
3. plus logit_bias[id];
4. -inf on the banned ids (EOS and stop_token_ids) while the output is shorter
   than min_tokens.

Only the rows of requests that ask for an adjustment are touched; a step without
any is never built (`SamplingMetadata.adjust` is None) and costs nothing.
Everything is built from host lists and copied without blocking: no sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atom.model_ops.host_copy import host_to_device

if TYPE_CHECKING:
    from atom.model_engine.batch import LogitAdjustWork


@dataclass(frozen=True)
class LogitAdjustments:
    """Device tensors for the P adjusted rows of a step, padded per row."""

    rows: torch.Tensor  # [P] long: the rows among the step's sampled sequences
    frequency: torch.Tensor  # [P] float32
    presence: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    # [P, L] long output history and [P, L] float32 weights (1 real, 0 padding).
    output_ids: torch.Tensor
    output_weights: torch.Tensor
    # [P, M] long distinct prompt ids and weights; only for repetition_penalty.
    prompt_ids: torch.Tensor
    prompt_weights: torch.Tensor
    # [P, B] long ids and float32 biases (padding: id 0, bias 0).
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    # [P, E] long ids and weights of the min_tokens ban.
    banned_ids: torch.Tensor
    banned_weights: torch.Tensor
    # [P] long: output tokens before the first scored row, and min_tokens.
    num_output_tokens: torch.Tensor
    min_tokens: torch.Tensor

    @classmethod
    def build(
        cls,
        adjusts: Sequence[LogitAdjustWork | None],
        device: torch.device | str,
    ) -> LogitAdjustments | None:
        """From each sampled sequence's LogitAdjustWork (None where the request
        adjusts nothing); None when no row adjusts anything."""
        rows = [i for i, adjust in enumerate(adjusts) if adjust is not None]
        if not rows:
            return None
        works = [adjusts[i] for i in rows]

        def floats(values: list[float]) -> torch.Tensor:
            return host_to_device(values, torch.float32, device)

        def longs(values: list[int]) -> torch.Tensor:
            return host_to_device(values, torch.long, device)

        def padded(lists: list[list], dtype: torch.dtype) -> torch.Tensor:
            width = max(1, max(len(entry) for entry in lists))
            values = [list(entry) + [0] * (width - len(entry)) for entry in lists]
            return host_to_device(values, dtype, device).view(len(lists), width)

        def ids_and_weights(lists: list[list[int]]) -> tuple[torch.Tensor, ...]:
            return padded(lists, torch.long), padded(
                [[1.0] * len(entry) for entry in lists], torch.float32
            )

        output_ids, output_weights = ids_and_weights(
            [w.output_token_ids for w in works]
        )
        prompt_ids, prompt_weights = ids_and_weights(
            [w.prompt_token_ids for w in works]
        )
        banned_ids, banned_weights = ids_and_weights(
            [w.banned_until_min_tokens for w in works]
        )
        return cls(
            rows=longs(rows),
            frequency=floats([w.frequency_penalty for w in works]),
            presence=floats([w.presence_penalty for w in works]),
            repetition=floats([w.repetition_penalty for w in works]),
            output_ids=output_ids,
            output_weights=output_weights,
            prompt_ids=prompt_ids,
            prompt_weights=prompt_weights,
            bias_ids=padded([list(w.logit_bias) for w in works], torch.long),
            bias_values=padded(
                [list(w.logit_bias.values()) for w in works], torch.float32
            ),
            banned_ids=banned_ids,
            banned_weights=banned_weights,
            num_output_tokens=longs([w.num_output_tokens for w in works]),
            min_tokens=longs([w.min_tokens for w in works]),
        )

    def apply(
        self,
        logits: torch.Tensor,
        draft_ids: torch.Tensor | None = None,
        num_drafts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[S, W, V] float32 adjusted copy of logits [S, W, V] (W = 1 + the drafts).

        draft_ids [S, W - 1] and num_drafts [S]: row j of sequence s counts its
        drafts 0..j-1 (at most num_drafts[s]) as output. Rows not adjusted keep
        their values (bf16 widens to float32 exactly).
        """
        num_rows, width, vocab = logits.shape
        picked = logits.index_select(0, self.rows).float()
        count = picked.shape[0]

        def per_token(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return picked.new_zeros(count, vocab).scatter_add_(1, ids, weights)

        counts = per_token(self.output_ids, self.output_weights).unsqueeze(1)
        counts = counts.repeat(1, width, 1)
        if width > 1:
            drafts = draft_ids.index_select(0, self.rows)
            real = num_drafts.index_select(0, self.rows).view(count, 1, 1)
            before = torch.arange(width - 1, device=logits.device).view(1, 1, -1)
            row = torch.arange(width, device=logits.device).view(1, -1, 1)
            taken = ((before < row) & (before < real)).float()
            counts.scatter_add_(
                2, drafts.unsqueeze(1).expand(count, width, width - 1), taken
            )
        in_output = counts > 0
        seen = in_output | (
            per_token(self.prompt_ids, self.prompt_weights) > 0
        ).unsqueeze(1)
        repetition = self.repetition.view(count, 1, 1)
        repeated = torch.where(picked > 0, picked / repetition, picked * repetition)
        picked = torch.where(seen, repeated, picked)
        picked = picked - self.frequency.view(count, 1, 1) * counts
        picked = picked - self.presence.view(count, 1, 1) * in_output.float()
        picked = picked + per_token(self.bias_ids, self.bias_values).unsqueeze(1)
        outputs_at_row = self.num_output_tokens.view(count, 1) + torch.arange(
            width, device=logits.device
        )
        too_short = outputs_at_row < self.min_tokens.view(count, 1)
        banned = per_token(self.banned_ids, self.banned_weights) > 0
        picked = picked.masked_fill(
            too_short.unsqueeze(2) & banned.unsqueeze(1), float("-inf")
        )
        return logits.float().index_copy(0, self.rows, picked)
