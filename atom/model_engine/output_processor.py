"""Token ids back to text: incremental detokenization and stop strings.

Without a tokenizer (skip_tokenizer_init) outputs carry token ids and empty text.
"""

from __future__ import annotations

from dataclasses import dataclass

from atom.model_engine.sequence import Sequence


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


@dataclass
class _Detok:
    seq: Sequence
    stops: list[str]
    num_tokens_seen: int = 0
    text: str = ""


class OutputProcessor:
    """Turns sequences the scheduler advanced into RequestOutputs.

    Returns the request ids whose text hit a stop string, so the engine can finish
    them; the text is cut before the stop string.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Detok] = {}
        self.request_of_seq: dict[int, str] = {}

    def add(self, seq: Sequence) -> None:
        stop = seq.sampling_params.stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.requests[seq.request_id] = _Detok(seq, stops)
        self.request_of_seq[seq.seq_id] = seq.request_id

    def drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            del self.request_of_seq[state.seq.seq_id]

    def update(self, request_id: str) -> tuple[RequestOutput, bool]:
        """(output, hit_stop_string) for one request after a step."""
        state = self.requests[request_id]
        seq = state.seq
        outputs = seq.output_token_ids
        new_ids = outputs[state.num_tokens_seen :]
        state.num_tokens_seen = len(outputs)
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(outputs, skip_special_tokens=True)
        if text.endswith("\ufffd") and not seq.is_finished:
            text = state.text  # a multi-byte character is still incomplete
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
            output_token_ids=list(outputs),
            new_token_ids=new_ids,
            text=text,
            new_text=new_text,
            finished=finished,
            finish_reason="stop" if hit else seq.finish_reason,
        )
        if finished:
            self.drop(request_id)
        return output, hit
