"""OpenAI-compatible request and response shapes for the HTTP server.

Requests ignore unknown fields (clients such as lm_eval send extras) but reject
wrong types and values atom cannot honour, naming the offending field. Types are
strict: `"5"` or `true` is not a token count, and `true` is not a temperature.
"""

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
)

from atom.sampling_params import MAX_SEED, SEED_RULE

TokenId = Annotated[StrictInt, Field(ge=0)]
# OpenAI's default for /v1/completions when a request names no max_tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def format_validation_error(error: ValidationError) -> str:
    """One line per problem, e.g. `max_tokens: Input should be greater than 0`."""
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "body"
        problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)


class OpenAIRequest(BaseModel):
    """Sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0)
    top_k: StrictInt | None = None
    top_p: StrictFloat | None = None
    max_tokens: StrictInt | None = Field(default=None, gt=0)
    max_completion_tokens: StrictInt | None = Field(default=None, gt=0)
    stop: str | list[str] | None = None
    ignore_eos: StrictBool = False
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: StrictInt = 1

    @field_validator("n")
    @classmethod
    def _single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be 1 (atom returns one choice), got {n}")
        return n

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, seed: int | None) -> int | None:
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be {SEED_RULE}, got {seed}")
        return seed

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for `SamplingParams`; unset fields keep its defaults."""
        kwargs: dict[str, Any] = {
            "max_tokens": self.max_completion_tokens
            or self.max_tokens
            or default_max_tokens,
            "ignore_eos": self.ignore_eos,
        }
        optional = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs


class CompletionRequest(OpenAIRequest):
    # A batch (list of strings or of token-id lists) yields one choice per prompt.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: StrictBool = False
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty_batch(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported by atom")
        return echo

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs:
            raise ValueError("logprobs are not supported by atom")
        return logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, a single prompt being a batch of one."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(item, int) for item in prompt):
            return [prompt]
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None

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
    # Accepted for client compatibility; atom does not act on them.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool) -> bool:
        if logprobs:
            raise ValueError("logprobs are not supported by atom")
        return logprobs

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


class CompletionChoice(BaseModel):
    index: int
    text: str
    # The generated ids (in a stream: this chunk's); set when the server runs
    # without a tokenizer (--skip-tokenizer-init), whose text is always empty.
    token_ids: list[int] | None = None
    logprobs: None = None
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


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: None = None
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
    logprobs: None = None
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
