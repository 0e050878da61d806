"""Log-probabilities of the emitted tokens, for the requests that ask for them.

The distribution reported is the target's softmax over the logits after the
request's penalties and logit_bias (atom/model_ops/logit_adjust.py) and before
temperature, top-k and top-p: the distribution greedy decoding takes the argmax
of, so a greedy token is always the top-1 alternative, and a request without
adjustments gets the model's raw log-probabilities. Under speculation the logprob
of an emitted token comes from the verify row that decided it, which holds the
same logits target-only decoding has at that position.

Prompt logprobs (`prompt_token_logprobs`) come from the raw logits of the prefill
rows: no output precedes a prompt token, so no penalty applies there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from atom.model_ops.host_copy import host_to_device
from atom.model_ops.token_logprob import TokenLogprob


@dataclass(frozen=True)
class LogprobRequest:
    """Which of a step's sampled sequences want logprobs, and how many top ones."""

    rows: torch.Tensor  # [P] long: rows among the step's sampled sequences
    rows_host: list[int]
    num_top_host: list[int]  # per wanted row

    @classmethod
    def build(
        cls, num_tops: Sequence[int | None], device: torch.device | str
    ) -> LogprobRequest | None:
        """From each sampled sequence's request (None: no logprobs); None when no
        sequence wants any."""
        rows = [i for i, k in enumerate(num_tops) if k is not None]
        if not rows:
            return None
        return cls(
            rows=host_to_device(rows, torch.long, device),
            rows_host=rows,
            num_top_host=[num_tops[i] for i in rows],
        )

    def compute(
        self, logits: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprob of each token [P, W], top logprobs [P, W, K], their ids
        [P, W, K]) for logits [S, W, V] and the tokens [S, W] decided at each
        row; K = the largest top count asked for this step."""
        picked = logits.index_select(0, self.rows).float().log_softmax(dim=-1)
        chosen = picked.gather(2, tokens.index_select(0, self.rows).unsqueeze(2))
        top = picked.topk(max(self.num_top_host), dim=-1)
        return chosen.squeeze(2), top.values, top.indices


# Prompt rows scored per pass: a chunk's logits all at once would take
# chunk x vocab x 4 bytes (16384 x 163840 x 4 = 10 GiB on Kimi-K3).
PROMPT_ROWS_PER_PASS = 512


def prompt_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    num_top: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[TokenLogprob]:
    """The logprob of targets[i] after hidden row i (and the num_top likeliest
    tokens there), from the model's raw logits, a bounded number of rows at a time.

    Every TP rank of the last stage calls this with the same rows (compute_logits
    gathers the vocabulary shards).
    """
    result: list[TokenLogprob] = []
    for start in range(0, hidden.shape[0], PROMPT_ROWS_PER_PASS):
        rows = slice(start, start + PROMPT_ROWS_PER_PASS)
        logprobs = compute_logits(hidden[rows]).float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets[rows].unsqueeze(1))
        top = logprobs.topk(num_top, dim=-1)
        values = torch.cat([chosen, top.values], dim=1).tolist()
        ids = top.indices.tolist()
        result.extend(
            TokenLogprob(token, row[0], list(zip(top_ids, row[1:])))
            for token, row, top_ids in zip(targets[rows].tolist(), values, ids)
        )
    return result
