"""Speculative decoding counters and ATOM's cumulative `[MTP Stats` log line.

Per verify step: n drafts verified (a sequence's `num_drafts`, at most T), a accepted.
Acceptance rate = sum(a) / sum(n); tokens per forward = 1 + sum(a) / steps =
1 + sum_k rho_k, where rho_k is the share of steps whose first k drafts were all
accepted. With n always T this is 1 + T * acceptance rate.
"""

from __future__ import annotations

from typing import Any


class SpecDecodeStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(
                f"SpecDecodeStats needs num_speculative_tokens >= 1, "
                f"got {num_speculative_tokens}"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.num_steps = 0
        self.total_draft_tokens = 0
        self.total_accepted_tokens = 0
        # accepted_count[a] = verify steps that accepted exactly a drafts.
        self.accepted_count = [0] * (num_speculative_tokens + 1)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if not 1 <= num_drafted <= self.num_speculative_tokens:
            raise ValueError(
                f"num_drafted must be in [1, {self.num_speculative_tokens}], "
                f"got {num_drafted}"
            )
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(
                f"num_accepted must be in [0, {num_drafted}], got {num_accepted}"
            )
        self.num_steps += 1
        self.total_draft_tokens += num_drafted
        self.total_accepted_tokens += num_accepted
        self.accepted_count[num_accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        if not self.total_draft_tokens:
            return 0.0
        return self.total_accepted_tokens / self.total_draft_tokens

    @property
    def avg_tokens_per_forward(self) -> float:
        if not self.num_steps:
            return 1.0
        return 1 + self.total_accepted_tokens / self.num_steps

    @property
    def accepted_per_position(self) -> list[int]:
        """For k = 1..T: verify steps that accepted at least k drafts, i.e. how
        often the k-th draft was accepted."""
        counts, at_least = [], self.num_steps
        for k in range(1, self.num_speculative_tokens + 1):
            at_least -= self.accepted_count[k - 1]
            counts.append(at_least)
        return counts

    @property
    def per_position_acceptance(self) -> list[float]:
        """rho_k for k = 1..T: share of steps that accepted at least k drafts."""
        steps = max(self.num_steps, 1)
        return [count / steps for count in self.accepted_per_position]

    @property
    def distribution(self) -> dict[int, float]:
        """Share of verify steps that accepted exactly a drafts, a = 0..T."""
        steps = max(self.num_steps, 1)
        return {a: n / steps for a, n in enumerate(self.accepted_count)}

    def format_line(self) -> str:
        """The cumulative line CI parses; the wording is ATOM's, unchanged."""
        shares = {a: f"{share:.2%}" for a, share in self.distribution.items()}
        return (
            f"[MTP Stats         ] "
            f"Average toks/fwd: {self.avg_tokens_per_forward:.2f}, "
            f"Accepted/Total Draft tokens: "
            f"{self.total_accepted_tokens}/{self.total_draft_tokens}, "
            f"Acceptance rate: {self.acceptance_rate:.2%}, "
            f"Accepted tokens distribution: {shares}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_verify_steps": self.num_steps,
            "total_draft_tokens": self.total_draft_tokens,
            "total_accepted_tokens": self.total_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "avg_tokens_per_forward": self.avg_tokens_per_forward,
            "accepted_per_position": self.accepted_per_position,
            "per_position_acceptance": self.per_position_acceptance,
            "distribution": self.distribution,
        }
