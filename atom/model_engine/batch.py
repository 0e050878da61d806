"""Messages that cross process boundaries: plain dataclasses of lists and ints."""

from __future__ import annotations

from dataclasses import dataclass, field

from atom.model_engine.sequence import Sequence
from atom.model_ops.token_logprob import TokenLogprob


@dataclass(kw_only=True)
class LogitAdjustWork:
    """What the last stage needs to adjust one sampled sequence's logits: its
    penalties and bias, and the token history they depend on (SamplingParams has
    the meaning of each setting)."""

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Ids the sampler may not emit while the output is shorter than min_tokens.
    min_tokens: int = 0
    banned_until_min_tokens: list[int] = field(default_factory=list)
    # The output so far (the sequence's first scored row predicts output number
    # len(output_token_ids)); sent only when a penalty is on.
    output_token_ids: list[int] = field(default_factory=list)
    # The prompt's distinct ids; sent only for repetition_penalty != 1.
    prompt_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0

    @classmethod
    def for_sequence(
        cls, seq: Sequence, eos_token_ids: frozenset[int]
    ) -> LogitAdjustWork:
        """The settings and history the last stage adjusts seq's logits with; the
        history travels only when a penalty needs it."""
        sp = seq.sampling_params
        banned = set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            banned |= eos_token_ids
        counts_outputs = sp.frequency_penalty or sp.presence_penalty
        repeats = sp.repetition_penalty != 1
        return cls(
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias=dict(sp.logit_bias or {}),
            min_tokens=sp.min_tokens,
            banned_until_min_tokens=sorted(banned) if sp.min_tokens else [],
            output_token_ids=(
                seq.output_token_ids if counts_outputs or repeats else []
            ),
            prompt_token_ids=seq.distinct_prompt_token_ids if repeats else [],
            num_output_tokens=seq.num_output_tokens,
        )


@dataclass(kw_only=True)
class SeqWork:
    """One sequence's rows in one forward (sampling fields default to greedy)."""

    seq_id: int
    # Prefill chunk, or [last_token] followed by the drafts to verify.
    token_ids: list[int]
    # Tokens already in the caches before these rows (= position of the first row).
    context_len: int
    block_table: list[int]
    # Recurrent state of the request; a first chunk (context_len 0) without a fork
    # starts from a zero state, as the slot may hold a finished request's state.
    state_slot: int
    # The last stage samples (or verifies) this sequence in this forward.
    sample: bool = True
    # Drafts among token_ids: token_ids = [last, d1..dT]; 0 when not verifying.
    num_drafts: int = 0
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    # Only for sampled sequences whose request adjusts its logits.
    logit_adjust: LogitAdjustWork | None = None
    # Log-probabilities wanted for the emitted tokens: how many top alternatives
    # (0 = the emitted token's only); None = none.
    logprobs: int | None = None
    # Prompt logprobs: the top count (None = none) and the prompt token each row
    # of this chunk predicts (the chunk's last row may predict none).
    prompt_logprobs: int | None = None
    prompt_logprob_targets: list[int] = field(default_factory=list)
    # Copy the KDA state of this checkpoint slot into state_slot BEFORE the forward.
    state_fork_src: int | None = None
    # Copy the KDA state of state_slot into this checkpoint slot AFTER the forward.
    state_save_dst: int | None = None
    # Async scheduling (run_ahead.py): token_ids are placeholders for what the
    # previous batch samples for this sequence, its last emitted token and the
    # drafts proposed after it; the runner fills them in on the device.
    input_pending: bool = False
    # With input_pending: the drafts the previous batch verified for this
    # sequence, whose acceptance was unknown here. context_len counts them all as
    # accepted; the runner takes the rejected ones back on the device (positions,
    # slots, context lengths) and commits the state of the last accepted row.
    unconfirmed_drafts: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.context_len, self.context_len + len(self.token_ids))


@dataclass
class ScheduledBatch:
    batch_id: int
    work: list[SeqWork]
    # (state_slot, num_accepted_rows) of sequences whose previous forward verified
    # drafts; every stage applies them before running this batch.
    spec_commits: list[tuple[int, int]] = field(default_factory=list)
    # The last stage drops per-sequence sampler and draft state of these.
    finished_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(work.token_ids) for work in self.work)

    @property
    def produces_output(self) -> bool:
        """Whether the last stage answers this batch with a BatchOutput."""
        return any(work.sample for work in self.work)

    @property
    def sample_seq_ids(self) -> list[int]:
        return [work.seq_id for work in self.work if work.sample]


@dataclass
class TokenChoice:
    """What the last stage decided for one sampled sequence in one step."""

    seq_id: int
    # Accepted drafts, then the correction or bonus token (or the one sampled token).
    token_ids: list[int]
    num_accepted: int
    # The drafts this sequence verifies next ([] without speculation).
    draft_token_ids: list[int]
    # One per token of token_ids when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # With prompt logprobs, on the step that samples the prompt's first output:
    # one per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class BatchOutput:
    """Exactly one per output-producing batch, sent by the last stage."""

    batch_id: int
    # One per sequence with sample=True, in batch order.
    choices: list[TokenChoice]

    @property
    def seq_ids(self) -> list[int]:
        return [choice.seq_id for choice in self.choices]

    def check_against(self, batch: ScheduledBatch, num_speculative_tokens: int) -> None:
        """Raise RuntimeError unless this is a consistent answer to `batch`."""
        if self.batch_id != batch.batch_id:
            raise RuntimeError(
                f"BatchOutput of batch {self.batch_id} arrived while postprocessing "
                f"batch {batch.batch_id}: the pipeline is out of step"
            )
        if self.seq_ids != batch.sample_seq_ids:
            raise RuntimeError(
                f"BatchOutput of batch {batch.batch_id} covers sequences "
                f"{self.seq_ids}, expected {batch.sample_seq_ids}"
            )
        works = [work for work in batch.work if work.sample]
        for work, choice in zip(works, self.choices):
            problem = _choice_problem(work, choice, num_speculative_tokens)
            if problem is not None:
                raise RuntimeError(
                    f"BatchOutput of batch {batch.batch_id}, sequence "
                    f"{work.seq_id}: {problem}"
                )


def _choice_problem(
    work: SeqWork, choice: TokenChoice, num_speculative_tokens: int
) -> str | None:
    """What is inconsistent in one sequence's choice, or None (the message is
    formed only on failure: this runs per sequence per step)."""
    if not (work.num_drafts or choice.num_accepted) and (
        len(choice.token_ids) == 1
        and len(choice.draft_token_ids) <= num_speculative_tokens
    ):
        return None  # a plain decode row: nothing to slice and compare
    verified = work.token_ids[1 : 1 + work.num_drafts]
    tokens, accepted = choice.token_ids, choice.num_accepted
    if not 0 <= accepted <= len(verified):
        return f"{accepted} accepted drafts of {len(verified)} verified"
    if len(tokens) != accepted + 1:
        return f"{len(tokens)} emitted tokens for {accepted} accepted drafts"
    # Pending rows were filled on the device: the host never saw those drafts.
    if not work.input_pending and tokens[:accepted] != verified[:accepted]:
        return (
            f"accepted tokens {tokens[:accepted]} differ from the drafts "
            f"{verified[:accepted]}"
        )
    if len(choice.draft_token_ids) > num_speculative_tokens:
        return (
            f"{len(choice.draft_token_ids)} drafts, at most "
            f"{num_speculative_tokens} expected"
        )
    return None
