"""Token ids back to text: incremental detokenization and stop strings.

Without a tokenizer (skip_tokenizer_init) outputs carry token ids and empty text.
"""

from __future__ import annotations

from dataclasses import dataclass

from atom.model_engine.sequence import Sequence
from atom.model_ops.token_logprob import TokenLogprob
from atom.utils.tokenizer import output_decoder


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None
    # Why this request failed (finish_reason "error"); the engine went on.
    error: str | None = None
    # Seconds the request waited to be scheduled (Sequence.queue_time).
    queue_time: float | None = None
    # With SamplingParams.logprobs: one per output token, and those of new_token_ids.
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token (the first None),
    # once the prefill computed them.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # P/D producer: where the consumer finds this request's KV (docs/pd.md).
    kv_transfer_params: dict | None = None


@dataclass
class _Detok:
    """One request's detokenization state.

    Text grows by decoding only a short window: the output ids from `prefix_offset`
    on, minus what the ids up to `read_offset` already decoded to. A window that
    ends inside a multi-byte character decodes to U+FFFD and waits for more ids.
    """

    seq: Sequence
    stops: list[str]
    # Only the finished output is wanted: the text is decoded once, at the end.
    final_only: bool = False
    num_tokens_seen: int = 0
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


class OutputProcessor:
    """Turns sequences the scheduler advanced into RequestOutputs.

    Returns the request ids whose text hit a stop string, so the engine can finish
    them; the text is cut before the stop string.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decode = None if tokenizer is None else output_decoder(tokenizer)
        self.requests: dict[str, _Detok] = {}
        self.request_of_seq: dict[int, str] = {}

    def add(self, seq: Sequence, final_only: bool = False) -> None:
        stops = seq.sampling_params.stop_strings
        self.requests[seq.request_id] = _Detok(seq, stops, final_only)
        self.request_of_seq[seq.seq_id] = seq.request_id

    def wants_output(self, request_id: str) -> bool:
        """Whether a step's output of this request is built: always, but for a
        final-only request until it finishes (its stop strings still need the text
        of every step, so such a request is decoded step by step too)."""
        state = self.requests[request_id]
        return not state.final_only or bool(state.stops) or state.seq.is_finished

    def drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            del self.request_of_seq[state.seq.seq_id]

    def _new_text(self, state: _Detok, outputs: list[int]) -> str:
        decode = self.decode
        seen = decode(outputs[state.prefix_offset : state.read_offset])
        window = decode(outputs[state.prefix_offset :])
        incomplete = window.endswith("\ufffd") and not state.seq.is_finished
        if len(window) <= len(seen) or incomplete:
            return ""
        state.prefix_offset, state.read_offset = state.read_offset, len(outputs)
        return window[len(seen) :]

    def fail(self, request_id: str, error: str) -> RequestOutput:
        """The final output of a request that failed with `error`."""
        state = self.requests[request_id]
        seq = state.seq
        self.drop(request_id)
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=list(seq.output_token_ids),
            new_token_ids=[],
            text=state.text,
            new_text="",
            finished=True,
            finish_reason="error",
            error=error,
            queue_time=seq.queue_time,
        )

    def update(self, request_id: str) -> tuple[RequestOutput, bool]:
        """(output, hit_stop_string) for one request after a step."""
        state = self.requests[request_id]
        seq = state.seq
        outputs = seq.output_token_ids
        new_ids = outputs[state.num_tokens_seen :]
        wants_logprobs = seq.sampling_params.logprobs is not None
        logprobs = list(seq.output_logprobs) if wants_logprobs else None
        new_logprobs = logprobs[state.num_tokens_seen :] if wants_logprobs else None
        state.num_tokens_seen = len(outputs)
        text = state.text
        if self.tokenizer is not None:
            text += self._new_text(state, outputs)
        hit = False
        for stop in state.stops:
            cut = text.find(stop, max(0, len(state.text) - len(stop)))
            if cut != -1:
                text, hit = text[:cut], True
        new_text = text[len(state.text) :]
        state.text = text
        finished = seq.is_finished or hit
        output = RequestOutput(
            request_id=request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=outputs,  # a fresh slice, the caller's to keep
            new_token_ids=new_ids,
            text=text,
            new_text=new_text,
            finished=finished,
            finish_reason="stop" if hit else seq.finish_reason,
            queue_time=seq.queue_time,
            logprobs=logprobs,
            new_logprobs=new_logprobs,
            prompt_logprobs=seq.prompt_logprobs,
            kv_transfer_params=seq.kv_transfer_output,
        )
        if finished:
            self.drop(request_id)
        return output, hit
