"""Per-request sampling settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

# The most alternatives per position a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20

# Seeds are signed 64-bit integers in the sampler; negative ones are refused too, so
# that one rule holds everywhere: an integer in [0, 2**63 - 1].
MAX_SEED = 2**63 - 1
SEED_RULE = f"an integer in [0, 2**63 - 1] = [0, {MAX_SEED}]"


# Choice i of a seeded request with n > 1 samples with seed_for_choice(seed, i):
# an odd step (2**63 / golden ratio) keeps the n seeds distinct.
_CHOICE_SEED_STEP = 0x4F1BBCDCBFA53E0B


def seed_for_choice(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed`; choice 0 keeps it."""
    return (seed + index * _CHOICE_SEED_STEP) % (MAX_SEED + 1)


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
    # Logit adjustments (atom/model_ops/logit_penalties.py applies them, in plain
    # sampling and in draft verification alike). OpenAI's ranges.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit; -100 bans it, +100 forces it.
    logit_bias: dict[int, float] | None = None
    # EOS (unless ignore_eos) and stop_token_ids cannot be sampled before this many
    # output tokens.
    min_tokens: int = 0
    # Tokens that end the request like EOS (the token is kept in the output ids).
    stop_token_ids: list[int] | None = None
    # Report each output token's log-probability (atom/model_ops/logprobs.py says
    # which distribution) with this many likeliest alternatives; None = off.
    logprobs: int | None = None
    # Report each prompt token's log-probability (the first is None: nothing
    # predicts it) with this many alternatives; computed in the prefill, which then
    # reuses no cached prefix. None = off.
    prompt_logprobs: int | None = None

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
        self._check_logit_adjustments()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS
            ):
                raise ValueError(
                    f"SamplingParams.{name} must be None or an int in "
                    f"[0, {MAX_TOP_LOGPROBS}], got {value!r}"
                )

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

    def _check_logit_adjustments(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(
                    f"SamplingParams.{name} must be a number in [-2, 2], got {value!r}"
                )
            setattr(self, name, float(value))
        rep = self.repetition_penalty
        if not _is_number(rep) or not math.isfinite(rep) or rep <= 0:
            raise ValueError(
                f"SamplingParams.repetition_penalty must be a finite number > 0 "
                f"(1 = off), got {rep!r}"
            )
        self.repetition_penalty = float(rep)
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(
                _is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100
                for k, v in bias.items()
            ):
                raise ValueError(
                    "SamplingParams.logit_bias must map token ids (ints >= 0) to "
                    f"numbers in [-100, 100], got {bias!r}"
                )
            self.logit_bias = {k: float(v) for k, v in bias.items()}
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be an int in [0, max_tokens = "
                f"{self.max_tokens}], got {self.min_tokens!r}"
            )
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids)
        ):
            raise ValueError(
                "SamplingParams.stop_token_ids must be a list of token ids "
                f"(ints >= 0), got {ids!r}"
            )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must adjust this request's logits (penalties, bias or
        a min_tokens ban); requests that do not skip that work entirely."""
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    @property
    def token_ids_to_check(self) -> list[int]:
        """Every token id the request names (to check against the vocabulary)."""
        return list(self.logit_bias or ()) + list(self.stop_token_ids or ())

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (empty when unset)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
