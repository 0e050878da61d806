"""Request handling for /v1/completions and /v1/chat/completions.

Each handler validates the body, turns it into engine requests, and answers
with one JSON body or an SSE stream (`data: <chunk>\\n\\n` frames; the finish
chunk, the optional usage chunk and `data: [DONE]` leave in one final write).
"""

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from atom.entrypoints.openai.api_error import APIError, error_for
from atom.entrypoints.openai.async_engine import AsyncEngine
from atom.entrypoints.openai.choices import (
    best_of_each,
    close_all,
    merged,
    params_per_choice,
    without_output,
)
from atom.entrypoints.openai.logprob_format import (
    chat_logprobs,
    completion_logprobs,
    token_texts,
)
from atom.entrypoints.openai.metrics import ServerMetrics
from atom.entrypoints.openai.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    OpenAIRequest,
    UsageInfo,
    format_validation_error,
    random_id,
)
from atom.model_ops.token_logprob import TokenLogprob
from atom.sampling_params import SamplingParams
from atom.utils.arithmetic import ceil_div
from atom.utils.tokenizer import apply_chat_template, max_bytes_per_token

logger = logging.getLogger(__name__)

T = TypeVar("T")
RequestT = TypeVar("RequestT", bound=OpenAIRequest)

# OpenAI's chat default is "until the context is full"; cap it as ATOM does.
CHAT_DEFAULT_MAX_TOKENS = 8192
DISCONNECT_POLL_S = 0.5


def with_transfer_params(response: BaseModel, output: Any) -> dict[str, Any]:
    """The response (or a stream's last chunk) as JSON, with a P/D producer's
    kv_transfer_params at top level, where the router reads them; other responses
    are unchanged."""
    body = response.model_dump()
    if output.kv_transfer_params is not None:
        body["kv_transfer_params"] = output.kv_transfer_params
    return body


def sse_frame(chunk: BaseModel | dict) -> str:
    data = chunk.model_dump() if isinstance(chunk, BaseModel) else chunk
    # allow_nan=False: SSE consumers parse strict JSON, so floats must be finite.
    text = json.dumps(data, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    chat_template: str | None,
    template_kwargs: dict[str, Any],
) -> str:
    """Chat prompt text (run in a preparation thread: templates can be slow)."""
    has_template = chat_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None:
        raise ValueError(
            "chat messages need a tokenizer, and this server runs with "
            "--skip-tokenizer-init: send token-id prompts to /v1/completions"
        )
    if not has_template or (chat_template is None and not template_kwargs):
        return apply_chat_template(tokenizer, messages)
    return tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=True,
        **template_kwargs,
    )


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
    finally:
        task.cancel()


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str,
        metrics: ServerMetrics,
        chat_template: str | None = None,
        default_chat_template_kwargs: dict[str, Any] | None = None,
    ):
        self.engine = engine
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.chat_template = chat_template
        self.default_chat_template_kwargs = default_chat_template_kwargs or {}
        # None: this tokenizer gives no bound, and text is judged once tokenized.
        self.max_bytes_per_token = max_bytes_per_token(engine.tokenizer)
        self.text_of = token_texts(engine.tokenizer)

    # ---- endpoints ----

    async def completions(self, request: Request):
        body = await self._parse(request, CompletionRequest)
        no_tokens = body.requested_max_tokens() == 0
        if no_tokens and not body.echo:
            raise APIError(
                400,
                f"{body.max_tokens_field()}: 0 asks for no tokens; it is served only "
                "with echo: true (the prompt and its logprobs)",
            )
        if body.echo and body.stream:
            raise APIError(400, "echo: not supported with stream: true")
        params = self._sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
        prompts = body.prompts()
        for prompt in prompts:
            self._check_token_ids(prompt)
            self._check_text_size(prompt, params.max_tokens)
        best_of = body.best_of or body.n
        if len(prompts) * best_of > MAX_CHOICES:
            raise APIError(
                400,
                f"{'best_of' if body.best_of else 'n'}: {len(prompts)} prompts x "
                f"{best_of} choices exceed {MAX_CHOICES} choices per request",
            )
        ranked = best_of > body.n and params.logprobs is None
        # Ranking needs every candidate's logprobs, asked for or not.
        per_choice = params_per_choice(
            replace(params, logprobs=0) if ranked else params, best_of
        )
        request_id = random_id("cmpl")
        self._check_transfer(body, len(prompts) * best_of)
        if not body.stream:
            # Choice index = prompt index x n + choice, as in the OpenAI API.
            jobs = [(prompt, choice) for prompt in prompts for choice in per_choice]
            outputs = await unless_disconnected(
                request, self._run_all(jobs, request_id, body.kv_transfer_params)
            )
            if no_tokens:
                outputs = [without_output(o) for o in outputs]
            # Usage counts every generated candidate, each prompt once.
            usage = self._usage(outputs, best_of)
            outputs = best_of_each(outputs, best_of, body.n)
            if ranked:
                outputs = [replace(o, logprobs=None) for o in outputs]
            prompt_of = [prompt for prompt in prompts for _ in range(body.n)]
            choices = [
                self._completion_choice(i, o, prompt_of[i] if body.echo else None)
                for i, o in enumerate(outputs)
            ]
            response = CompletionResponse(
                id=request_id,
                model=self.served_model_name,
                choices=choices,
                usage=usage,
            )
            return JSONResponse(with_transfer_params(response, outputs[0]))
        if len(prompts) != 1:
            raise APIError(400, "prompt: streaming accepts a single prompt")

        def chunk(
            index: int, output: Any, finish_reason: str | None
        ) -> CompletionResponse:
            choice = CompletionChoice(
                index=index,
                text=output.new_text,
                token_ids=self._ids(output.new_token_ids),
                logprobs=self._completion_logprobs(
                    output.new_logprobs,
                    output.new_token_ids,
                    len(output.text) - len(output.new_text),
                ),
                finish_reason=finish_reason,
            )
            return CompletionResponse(
                id=request_id, model=self.served_model_name, choices=[choice]
            )

        def usage_chunk(usage: UsageInfo) -> CompletionResponse:
            return CompletionResponse(
                id=request_id, model=self.served_model_name, choices=[], usage=usage
            )

        return await self._stream(
            request, body, prompts[0], per_choice, request_id, [], chunk, usage_chunk
        )

    async def chat_completions(self, request: Request):
        body = await self._parse(request, ChatCompletionRequest)
        try:
            messages = body.chat_messages()
        except ValueError as error:
            raise APIError(400, str(error)) from None
        template_kwargs = {
            **self.default_chat_template_kwargs,
            **(body.chat_template_kwargs or {}),
        }
        try:
            prompt = await self.engine.prepare(
                render_chat,
                self.engine.tokenizer,
                messages,
                self.chat_template,
                template_kwargs,
            )
        except Exception as error:
            raise APIError(400, f"messages: chat template failed: {error}") from None
        # 1: the least any request asks for; its own max_tokens is judged below.
        self._check_text_size(prompt, 1)
        # Tokenized here, not in generate(): the default max_tokens is what is left
        # of the context, and the engine refuses any request that does not fit.
        prompt = await self.engine.encode(prompt)
        room = self.engine.max_model_len - len(prompt)
        # At least 1, so that a prompt with no room left gets the engine's message.
        default_max_tokens = max(1, min(CHAT_DEFAULT_MAX_TOKENS, room))
        if body.requested_max_tokens() == 0:
            raise APIError(
                400,
                f"{body.max_tokens_field()}: must be >= 1 (0 is served only by "
                "/v1/completions with echo: true)",
            )
        params = self._sampling_params(body, default_max_tokens)
        per_choice = params_per_choice(params, body.n)
        request_id = random_id("chatcmpl")
        self._check_transfer(body, body.n)
        if not body.stream:
            jobs = [(prompt, choice) for choice in per_choice]
            outputs = await unless_disconnected(
                request, self._run_all(jobs, request_id, body.kv_transfer_params)
            )
            choices = [
                ChatChoice(
                    index=i,
                    message=ChatResponseMessage(content=output.text),
                    logprobs=self._chat_logprobs(output.logprobs),
                    finish_reason=output.finish_reason,
                )
                for i, output in enumerate(outputs)
            ]
            response = ChatCompletionResponse(
                id=request_id,
                model=self.served_model_name,
                choices=choices,
                usage=self._usage(outputs, body.n),
            )
            return JSONResponse(with_transfer_params(response, outputs[0]))

        def chunk(
            index: int, output: Any, finish_reason: str | None
        ) -> ChatCompletionChunk:
            text = output.new_text
            choice = ChatChunkChoice(
                index=index,
                delta={"content": text} if text else {},
                logprobs=self._chat_logprobs(output.new_logprobs),
                finish_reason=finish_reason,
            )
            return ChatCompletionChunk(
                id=request_id, model=self.served_model_name, choices=[choice]
            )

        def usage_chunk(usage: UsageInfo) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=request_id, model=self.served_model_name, choices=[], usage=usage
            )

        opening = [
            ChatCompletionChunk(
                id=request_id,
                model=self.served_model_name,
                choices=[
                    ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})
                ],
            )
            for i in range(body.n)
        ]
        return await self._stream(
            request, body, prompt, per_choice, request_id, opening, chunk, usage_chunk
        )

    # ---- helpers ----

    async def _parse(self, request: Request, model: type[RequestT]) -> RequestT:
        # Off the event loop: a body of megabytes takes a while to decode.
        data = await request.body()
        try:
            raw = await self.engine.prepare(json.loads, data)
        except RecursionError:
            raise APIError(400, "malformed JSON body: nested too deeply") from None
        except ValueError as error:
            raise APIError(400, f"malformed JSON body: {error}") from None
        try:
            body = await self.engine.prepare(model.model_validate, raw)
        except ValidationError as error:
            raise APIError(400, format_validation_error(error)) from None
        except RecursionError:
            raise APIError(400, "request body: nested too deeply") from None
        if body.model is not None and body.model != self.served_model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server serves "
                f"{self.served_model_name!r}",
                "not_found_error",
            )
        return body

    def _sampling_params(
        self, body: OpenAIRequest, default_max_tokens: int
    ) -> SamplingParams:
        try:
            params = SamplingParams(**body.sampling_kwargs(default_max_tokens))
        except (ValueError, TypeError) as error:
            # Its messages say `SamplingParams.top_p`; the request calls it `top_p`.
            message = str(error).removeprefix(f"{SamplingParams.__name__}.")
            raise APIError(400, message) from None
        named = {
            "logit_bias": params.logit_bias,
            "stop_token_ids": params.stop_token_ids,
        }
        for field, token_ids in named.items():
            bad = [t for t in token_ids or () if t >= self.engine.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"{field}: token ids {bad[:5]} are outside the vocabulary "
                    f"(size {self.engine.vocab_size})",
                )
        return params

    def _completion_choice(
        self, index: int, output: Any, echoed: str | list[int] | None
    ) -> CompletionChoice:
        """A finished choice; with `echoed` (the prompt as sent) the prompt leads
        its text, ids and logprobs (the prompt's own logprobs, the first None)."""
        text, token_ids, logprobs = (
            output.text,
            output.output_token_ids,
            output.logprobs,
        )
        if echoed is not None:
            prompt_ids = output.prompt_token_ids
            prompt_text = echoed if isinstance(echoed, str) else self._text(prompt_ids)
            text, token_ids = prompt_text + text, prompt_ids + token_ids
            if logprobs is not None:
                logprobs = output.prompt_logprobs + logprobs
        return CompletionChoice(
            index=index,
            text=text,
            token_ids=self._ids(token_ids),
            logprobs=self._completion_logprobs(logprobs, token_ids),
            finish_reason=output.finish_reason,
        )

    def _text(self, token_ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode(token_ids)

    def _completion_logprobs(
        self,
        logprobs: list[TokenLogprob | None] | None,
        token_ids: list[int],
        text_offset: int = 0,
    ) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        return completion_logprobs(logprobs, token_ids, self.text_of, text_offset)

    def _chat_logprobs(
        self, logprobs: list[TokenLogprob] | None
    ) -> ChatLogprobs | None:
        return None if logprobs is None else chat_logprobs(logprobs, self.text_of)

    def _ids(self, token_ids: list[int]) -> list[int] | None:
        """Token ids for a response: only a server without a tokenizer sends them."""
        return None if self.engine.has_tokenizer else list(token_ids)

    def _check_token_ids(self, prompt: str | list[int]) -> None:
        # An id outside the vocabulary would crash the forward pass, taking every
        # other request down with it, so it is refused here.
        if isinstance(prompt, list):
            bad = [t for t in prompt if t >= self.engine.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"prompt: token ids {bad[:5]} are outside the vocabulary "
                    f"(size {self.engine.vocab_size})",
                )

    def _generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """The engine's outputs for one prompt, observed by the server metrics."""
        outputs = self.engine.generate(
            prompt, params, request_id, kv_transfer_params=kv_transfer_params
        )
        return self.metrics.track(outputs)

    @staticmethod
    def _check_transfer(body: OpenAIRequest, num_choices: int) -> None:
        """P/D moves one sequence's KV: one prompt, one choice."""
        if body.kv_transfer_params is not None and num_choices != 1:
            raise APIError(
                400, "kv_transfer_params: P/D takes a single prompt and one choice"
            )

    def _check_text_size(self, prompt: str | list[int], max_tokens: int) -> None:
        """Refuse a text prompt that cannot fit the context on its size alone.

        Tokenizing megabytes takes seconds, and a text of B bytes is at least
        ceil(B / max_bytes_per_token) tokens (see max_bytes_per_token), so a
        refusal here is one the engine would give after tokenizing, only sooner.
        """
        if not isinstance(prompt, str) or self.max_bytes_per_token is None:
            return
        size = len(prompt.encode("utf-8"))
        fewest = ceil_div(size, self.max_bytes_per_token)
        limit = self.engine.max_model_len
        if fewest + max_tokens > limit:
            raise APIError(
                400,
                f"prompt of {size} bytes is at least {fewest} tokens (a token of "
                f"this tokenizer spells at most {self.max_bytes_per_token} bytes); "
                f"with max_tokens={max_tokens} it exceeds max_model_len={limit}: "
                "shorten the prompt",
            )

    async def _run_all(
        self,
        jobs: list[tuple[str | list[int], SamplingParams]],
        request_id: str,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Final outputs of all (prompt, params) jobs, run concurrently; one failure
        cancels all."""

        async def final_output(index: int, prompt: str | list[int], params) -> Any:
            final = None
            suffix = f"-{index}" if len(jobs) > 1 else ""
            outputs = self._generate(
                prompt, params, request_id + suffix, kv_transfer_params
            )
            async for output in outputs:
                final = output
            return final

        tasks = [
            asyncio.ensure_future(final_output(i, prompt, params))
            for i, (prompt, params) in enumerate(jobs)
        ]
        try:
            return await asyncio.gather(*tasks)
        except Exception as error:
            raise error_for(error) from None
        finally:
            for task in tasks:
                task.cancel()

    @staticmethod
    def _usage(outputs: list[Any], choices_per_prompt: int) -> UsageInfo:
        """Every choice's generated tokens, and each prompt's tokens once (its
        choices are consecutive outputs)."""
        return UsageInfo.of(
            sum(len(o.prompt_token_ids) for o in outputs[::choices_per_prompt]),
            sum(len(o.output_token_ids) for o in outputs),
        )

    async def _stream(
        self,
        request: Request,
        body: OpenAIRequest,
        prompt: str | list[int],
        per_choice: list[SamplingParams],
        request_id: str,
        opening: list[BaseModel],
        chunk: Callable[[int, Any, str | None], BaseModel],
        usage_chunk: Callable[[UsageInfo], BaseModel],
    ) -> StreamingResponse:
        """One SSE stream of every choice's chunks, each naming its choice index;
        the usage chunk (summed over the choices) and [DONE] follow the last."""
        several = len(per_choice) > 1
        streams = [
            self._generate(
                prompt,
                params,
                request_id + (f"-{i}" if several else ""),
                body.kv_transfer_params,
            )
            for i, params in enumerate(per_choice)
        ]
        starts = [asyncio.ensure_future(anext(stream)) for stream in streams]
        try:
            # Waiting for the first outputs means a rejected prompt still gets a
            # proper 4xx status instead of an error inside a 200 stream.
            firsts = await unless_disconnected(request, asyncio.gather(*starts))
        except BaseException as error:
            await close_all(streams, starts)
            if isinstance(error, Exception):
                raise error_for(error) from None
            raise
        include_usage = body.include_usage_in_stream()

        async def frames() -> AsyncIterator[str]:
            pending = "".join(sse_frame(c) for c in opening)
            finals: dict[int, Any] = {}
            try:
                async for index, output in merged(streams, firsts):
                    if output.finished:
                        finals[index] = output
                        last = chunk(index, output, output.finish_reason)
                        pending += sse_frame(with_transfer_params(last, output))
                        if len(finals) < len(streams):
                            continue
                        if include_usage:
                            usage = self._usage(list(finals.values()), len(finals))
                            pending += sse_frame(usage_chunk(usage))
                        yield pending + SSE_DONE
                        return
                    if (
                        output.new_text
                        or self._ids(output.new_token_ids)
                        or output.new_logprobs
                    ):
                        yield pending + sse_frame(chunk(index, output, None))
                        pending = ""
            except Exception as error:
                failure = error_for(error)
                info = ErrorInfo(
                    message=failure.message, type=failure.kind, code=failure.status
                )
                yield sse_frame(ErrorResponse(error=info)) + SSE_DONE

        return StreamingResponse(
            frames(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
