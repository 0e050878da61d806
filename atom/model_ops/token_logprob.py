"""One token's log-probability, as the engine reports it (torch-free: the head
process and the CLI import it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A token's log-probability under the target, and the likeliest tokens there."""

    token_id: int
    logprob: float
    # (token id, logprob) of the most likely tokens at this position, likeliest
    # first; as many as the request asked for.
    top: list[tuple[int, float]] = field(default_factory=list)
