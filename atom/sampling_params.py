"""Per-request sampling settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Seeds are signed 64-bit integers in the sampler; negative ones are refused too, so
# that one rule holds everywhere: an integer in [0, 2**63 - 1].
MAX_SEED = 2**63 - 1
SEED_RULE = f"an integer in [0, 2**63 - 1] = [0, {MAX_SEED}]"


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `top_k=True` is a caller bug, not a value.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise TypeError(
                f"SamplingParams.temperature must be a finite number, "
                f"got {self.temperature!r}"
            )
        if self.temperature < 0:
            raise ValueError(
                f"SamplingParams.temperature must be >= 0 (0 = greedy), "
                f"got {self.temperature}"
            )
        self.temperature = float(self.temperature)
        if not _is_int(self.top_k):
            raise TypeError(f"SamplingParams.top_k must be an int, got {self.top_k!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(
                f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}"
            )
        if not _is_number(self.top_p):
            raise TypeError(
                f"SamplingParams.top_p must be a number, got {self.top_p!r}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(
                f"SamplingParams.top_p must be in (0, 1], got {self.top_p}"
            )
        self.top_p = float(self.top_p)
        if not _is_int(self.max_tokens):
            raise TypeError(
                f"SamplingParams.max_tokens must be an int, got {self.max_tokens!r}"
            )
        if self.max_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(
                f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}"
            )
        self._check_stop()
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(
                f"SamplingParams.seed must be {SEED_RULE} or None, got {self.seed!r}"
            )
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(
                f"SamplingParams.seed must be {SEED_RULE}, got {self.seed}"
            )
        if not _is_int(self.n):
            raise TypeError(f"SamplingParams.n must be an int, got {self.n!r}")
        if self.n != 1:
            raise ValueError(f"SamplingParams.n: only n=1 is supported, got {self.n!r}")

    def _check_stop(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is None:
            return
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise TypeError(
                f"SamplingParams.stop must be a string, a list of strings or None, "
                f"got {self.stop!r}"
            )
        if any(s == "" for s in stops):
            raise ValueError("SamplingParams.stop must not contain an empty string")

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (empty when unset)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
