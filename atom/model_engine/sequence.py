"""One request's state as the scheduler sees it (tokens, caches, speculation)."""

from __future__ import annotations

import functools
import itertools
import time
from enum import Enum, auto

from atom.model_ops.token_logprob import TokenLogprob
from atom.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    # P/D consumer: admitted (blocks and state slot held), its KV still to arrive.
    WAITING_FOR_REMOTE_KVS = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Request state. Plain python data only, so it pickles cheaply.

    `num_computed_tokens` counts the tokens whose KV and state are in the caches or
    are being written by a batch already scheduled; drafts are never counted before
    they are accepted.
    """

    _next_id = itertools.count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict | None = None,
    ) -> None:
        if not isinstance(token_ids, list) or not token_ids:
            raise ValueError("Sequence needs a non-empty list of prompt token ids")
        bad = [t for t in token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(
                f"Sequence prompt token ids must be non-negative ints, got {bad[:5]}"
            )
        self.seq_id: int = next(Sequence._next_id)
        self.request_id: str = (
            request_id if request_id is not None else str(self.seq_id)
        )
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens: int = len(token_ids)
        self.sampling_params: SamplingParams = sampling_params or SamplingParams()
        self.status = SequenceStatus.WAITING
        # time.monotonic() clock.
        self.arrival_time: float = (
            arrival_time if arrival_time is not None else time.monotonic()
        )
        # When the scheduler first admitted it (same clock); None while it waits.
        self.first_scheduled_time: float | None = None
        self.finish_reason: str | None = None

        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        # xxh64 chain over the full blocks of token_ids (grows with the tokens).
        self.block_hashes: list[int] = []
        # Leading entries of block_table registered in the prefix cache.
        self.num_hashed_blocks = 0

        self.state_slot: int | None = None
        # Prefix hit on a hybrid model: checkpoint to copy into state_slot first.
        self.state_fork_src: int | None = None
        self.spec_token_ids: list[int] = []
        # One per output token when the request asks for logprobs.
        self.output_logprobs: list[TokenLogprob] = []
        # With SamplingParams.prompt_logprobs, once the prefill delivered them: one
        # per prompt token, the first None.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        # The batches whose output this sequence waits for, oldest first: one, or
        # two when async scheduling runs it ahead of its sampled token.
        self.in_flight_batch_ids: list[int] = []
        # Drafts its newest scheduled batch verifies (async scheduling runs the next
        # batch before their acceptance is known).
        self.drafts_in_flight = 0
        # P/D (docs/pd.md): what the request asked (`do_remote_decode` on a
        # producer, the producer's reply on a consumer), and a producer's reply.
        self.kv_transfer_params: dict | None = kv_transfer_params
        self.kv_transfer_output: dict | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
            f"status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @functools.cached_property
    def prompt_token_ids(self) -> list[int]:
        """The prompt, sliced once: every step's output of the request carries it,
        and a long prompt's copy per step per sequence adds up at large batches."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @functools.cached_property
    def distinct_prompt_token_ids(self) -> list[int]:
        """The prompt's ids, each once (repetition_penalty sends it every step)."""
        return sorted(set(self.prompt_token_ids))

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether its prefill must still compute the prompt's logprobs (and so
        may reuse no cached prefix: the skipped rows would have none)."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and self.prompt_logprobs is None

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first admission; None until admitted."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_tokens(
        self, tokens: list[int], eos_token_ids: frozenset[int], max_model_len: int
    ) -> str | None:
        """Append token by token up to the first token-level stop (EOS unless
        ignore_eos, a stop_token_ids entry, max_tokens, max_model_len), dropping the rest; returns the
        finish reason or None. Stop strings are the detokenizer's job."""
        sp = self.sampling_params
        for token in tokens:
            self.token_ids.append(token)
            if not sp.ignore_eos and token in eos_token_ids:
                return "stop"
            if sp.stop_token_ids and token in sp.stop_token_ids:
                return "stop"
            if self.num_output_tokens >= sp.max_tokens:
                return "length"
            if len(self.token_ids) >= max_model_len:
                return "length"
        return None
