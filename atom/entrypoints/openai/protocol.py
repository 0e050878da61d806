"""OpenAI-compatible request and response shapes for the HTTP server.

Every request field is either honoured or refused with a 400 naming it: unknown
fields are refused, and the OpenAI fields atom does not implement are accepted only
at the value that asks for nothing (what clients send by default). Types are
strict: `"5"` or `true` is not a token count, and `true` is not a temperature.
docs/serving.md has the table of every field.
"""

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from atom.sampling_params import MAX_SEED, MAX_TOP_LOGPROBS, SEED_RULE

TokenId = Annotated[StrictInt, Field(ge=0)]
# NaN and infinity are refused here: Python's JSON parser accepts `NaN`.
FiniteFloat = Annotated[StrictFloat, Field(allow_inf_nan=False)]
FiniteNumber = StrictInt | FiniteFloat
Penalty = Annotated[FiniteNumber, Field(ge=-2, le=2)]
Bias = Annotated[FiniteNumber, Field(ge=-100, le=100)]
# The most choices one request may ask for (n, or best_of, times its prompts).
MAX_CHOICES = 128
ChoiceCount = Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)]
TopCount = Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]
# OpenAI's default for /v1/completions when a request names no max_tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# The OpenAI fields atom does not implement: the test for the value that asks for
# nothing (served), and how the refusal describes it. Any other value is a 400.
UNIMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # `type(v)`, not isinstance: `false` is no number, though False == 0 in Python.
    "suffix": (lambda v: False, "null"),
    "tools": (lambda v: False, "null"),
    "tool_choice": (lambda v: False, "null"),
    "functions": (lambda v: False, "null"),
    "function_call": (lambda v: False, "null"),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}'),
    "reasoning_effort": (lambda v: False, "null"),
}


def refuse_unimplemented(value: Any, info: ValidationInfo) -> Any:
    """Pass a field of UNIMPLEMENTED through when it asks for nothing."""
    asks_nothing, accepted = UNIMPLEMENTED[info.field_name]
    if value is None or asks_nothing(value):
        return value
    raise ValueError(
        f"{info.field_name} is not implemented by atom; send {accepted} or leave it out"
    )


def _problem(item: dict[str, Any]) -> tuple[str, str]:
    """Where and what, in the request's terms: pydantic's union-member tags and
    model class names are left out of the location and of the message."""
    kind = item["type"]
    *path, last = item["loc"] or ("",)
    if kind != "extra_forbidden":  # there the last part is the unknown field
        path.append(last)
    where = ".".join(
        str(part) for part in path if isinstance(part, int) or part in FIELD_NAMES
    )
    if kind == "extra_forbidden":
        return (
            ".".join(filter(None, [where, str(last)])),
            "unknown field: atom does not accept it",
        )
    if kind == "value_error":
        return where or "body", str(item["ctx"]["error"])
    if kind == "model_type":
        return where or "body", "must be a JSON object"
    return where or "body", item["msg"]


def format_validation_error(error: ValidationError) -> str:
    """One line per problem, e.g. `max_tokens: Input should be greater than 0`; the
    alternatives of one field (a prompt may be text or token ids) are joined."""
    problems: dict[str, list[str]] = {}
    for item in error.errors():
        where, message = _problem(item)
        if message not in problems.setdefault(where, []):
            problems[where].append(message)
    return "; ".join(f"{where}: {' or '.join(m)}" for where, m in problems.items())


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class OpenAIRequest(BaseModel):
    """Sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: FiniteFloat | None = Field(default=None, ge=0)
    top_k: StrictInt | None = None
    top_p: FiniteFloat | None = None
    # 0 asks for no tokens: served only by /v1/completions with echo (serving.py).
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    ignore_eos: StrictBool = False
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: ChoiceCount = 1
    # An end-user id for the provider's abuse monitoring; it never changes output.
    user: str | None = None
    # P/D (docs/pd.md): `{"do_remote_decode": true}` to a producer, the producer's
    # reply (plus `remote_url`) to a consumer; the router sets them.
    kv_transfer_params: dict[str, Any] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    # vLLM's extensions: > 1 discourages every token of the prompt and the output.
    repetition_penalty: FiniteNumber | None = Field(default=None, gt=0)
    # OpenAI sends the token ids as JSON object keys, so as strings.
    logit_bias: dict[str, Bias] | None = None
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    stop_token_ids: list[TokenId] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(
        cls, bias: dict[str, float] | None
    ) -> dict[str, float] | None:
        bad = [key for key in bias or {} if not key.isdigit()]
        if bad:
            raise ValueError(
                f"logit_bias keys must be token ids (non-negative integers), got "
                f"{bad[:5]}"
            )
        return bias

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, seed: int | None) -> int | None:
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be {SEED_RULE}, got {seed}")
        return seed

    def logprobs_wanted(self) -> int | None:
        """SamplingParams.logprobs: the top count, or None for no logprobs."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        """SamplingParams.prompt_logprobs: the top count, or None."""
        return None

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens, else None (the default)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The name of the field requested_max_tokens comes from, for messages."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "max_tokens"

    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for `SamplingParams`; unset fields keep its defaults."""
        max_tokens = self.requested_max_tokens()
        kwargs: dict[str, Any] = {
            # A request for 0 tokens runs one, which the server leaves out.
            "max_tokens": (
                default_max_tokens if max_tokens is None else max(max_tokens, 1)
            ),
            "ignore_eos": self.ignore_eos,
            "prompt_logprobs": self.prompt_logprobs_wanted(),
        }
        optional = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": (
                None
                if self.logit_bias is None
                else {int(key): value for key, value in self.logit_bias.items()}
            ),
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "logprobs": self.logprobs_wanted(),
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs


class CompletionRequest(OpenAIRequest):
    # A batch (list of strings or of token-id lists) yields one choice per prompt.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    # Prepend the prompt to the text (and, with logprobs, its tokens' logprobs).
    echo: StrictBool = False
    # The number of likeliest alternatives per token (0: the token's own only).
    logprobs: TopCount | None = None
    # Generate best_of choices per prompt and return the n of the highest
    # cumulative logprob.
    best_of: ChoiceCount | None = None
    suffix: Any = None

    _unimplemented_here = field_validator("suffix")(refuse_unimplemented)

    @field_validator("best_of")
    @classmethod
    def _at_least_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of must be >= n = {n}, got {best_of}")
        if best_of is not None and best_of > n and info.data.get("stream"):
            raise ValueError("best_of must equal n when streaming")
        return best_of

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _non_empty_batch(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, a single prompt being a batch of one."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(item, int) for item in prompt):
            return [prompt]
        return list(prompt)


EMPTY_VALUES = (None, "", [], {})


class ChatMessage(BaseModel):
    # Other keys are accepted empty, as clients send an earlier reply back with
    # `"tool_calls": null` or `"refusal": null`; with a value (`name`, tool calls)
    # they would change the prompt, and atom renders role and content only.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _no_other_keys_with_values(self) -> "ChatMessage":
        filled = [
            k for k, v in (self.model_extra or {}).items() if v not in EMPTY_VALUES
        ]
        if filled:
            raise ValueError(
                f"message keys {filled} are not supported by atom (only role and "
                "content; other keys only when empty)"
            )
        return self

    def text(self) -> str:
        """The message content; multi-part content must be all text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"only text content parts are supported, got {part.get('type')!r}"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] | None = None
    prompt: str | None = None  # accepted as an alias for a single user message
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: StrictBool = False
    top_logprobs: TopCount | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    reasoning_effort: Any = None

    _unimplemented_here = field_validator(
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "reasoning_effort",
    )(refuse_unimplemented)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(
        cls, top: int | None, info: ValidationInfo
    ) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as plain role/content dicts for a chat template."""
        if self.messages:
            return [{"role": m.role, "content": m.text()} for m in self.messages]
        if self.prompt is not None:
            return [{"role": "user", "content": self.prompt}]
        raise ValueError("messages: field required (a non-empty list of messages)")


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    # None for a prompt's first token, which nothing predicts.
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    # The generated ids (in a stream: this chunk's); set when the server runs
    # without a tokenizer (--skip-tokenizer-init), whose text is always empty.
    token_ids: list[int] | None = None
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, str]  # only the keys that changed: role first, then content
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "atom"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


# Every field name of a request, for locating a validation problem (see _problem).
FIELD_NAMES = frozenset(
    name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, StreamOptions)
    for name in model.model_fields
)
