"""Engine TokenLogprobs in the OpenAI response shapes.

A token is shown as its decoded text (`token_id:N` without a tokenizer, the form
vLLM uses). Strict JSON has no -inf, so a log-probability of a banned token is
reported as MIN_LOGPROB.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from atom.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)
from atom.model_ops.token_logprob import TokenLogprob

MIN_LOGPROB = -9999.0


def token_texts(tokenizer: Any) -> Callable[[int], str]:
    """The text each token id is shown as."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def completion_logprobs(
    logprobs: list[TokenLogprob | None],
    token_ids: list[int],
    text_of: Callable[[int], str],
    text_offset: int = 0,
) -> CompletionLogprobs:
    """The legacy shape for token_ids (None where nothing predicts the token);
    offsets count characters from `text_offset`."""
    shaped = CompletionLogprobs()
    for token_id, logprob in zip(token_ids, logprobs):
        text = text_of(token_id)
        shaped.tokens.append(text)
        shaped.text_offset.append(text_offset)
        text_offset += len(text)
        if logprob is None:
            shaped.token_logprobs.append(None)
            shaped.top_logprobs.append(None)
            continue
        shaped.token_logprobs.append(_finite(logprob.logprob))
        top: dict[str, float] = {}
        for top_id, top_logprob in logprob.top:
            top.setdefault(text_of(top_id), _finite(top_logprob))
        shaped.top_logprobs.append(top)
    return shaped


def chat_logprobs(
    logprobs: list[TokenLogprob], text_of: Callable[[int], str]
) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {
            "token": text,
            "logprob": _finite(logprob),
            "bytes": list(text.encode("utf-8")),
        }

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **entry(lp.token_id, lp.logprob),
                top_logprobs=[ChatTopLogprob(**entry(i, v)) for i, v in lp.top],
            )
            for lp in logprobs
        ]
    )
