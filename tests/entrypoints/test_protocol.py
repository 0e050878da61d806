import pytest
from pydantic import ValidationError

from atom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    format_validation_error,
)
from atom.sampling_params import SamplingParams


def validation_message(model, body: dict) -> str:
    with pytest.raises(ValidationError) as error:
        model.model_validate(body)
    return format_validation_error(error.value)


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens: Input should be greater"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens: Input should be a valid"),
        ({"prompt": "hi", "max_completion_tokens": -1}, "max_completion_tokens:"),
        ({"prompt": "hi", "temperature": -0.5}, "temperature: Input should be greater"),
        ({"prompt": "hi", "n": 129}, "n: Input should be less than or equal to 128"),
        ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of: best_of must be >= n = 3"),
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": "hi", "stream": "sometimes"}, "stream"),
        ({"prompt": 12}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": []}, "prompt must not be an empty list"),
        ({"max_tokens": 4}, "prompt: Field required"),
        ({"prompt": "hi", "echo": 1}, "echo: Input should be a valid boolean"),
        (
            {"prompt": "hi", "logprobs": 21},
            "logprobs: Input should be less than or equal to 20",
        ),
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens: Input should be a valid"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens: Input should be a valid"),
        ({"prompt": "hi", "n": True}, "n: Input should be a valid integer"),
        ({"prompt": "hi", "top_k": "5"}, "top_k: Input should be a valid integer"),
        ({"prompt": "hi", "seed": "5"}, "seed: Input should be a valid integer"),
        ({"prompt": "hi", "seed": 2**64}, "seed: seed must be an"),
        ({"prompt": "hi", "seed": -1}, "[0, 2**63 - 1]"),
        ({"prompt": "hi", "temperature": True}, "temperature: Input should be a"),
        ({"prompt": "hi", "top_p": "0.5"}, "top_p: Input should be a valid number"),
        ({"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos: Input should be a"),
        ({"prompt": [1, True]}, "prompt"),
    ],
)
def test_completion_request_errors_name_the_field(body, expected):
    assert expected in validation_message(CompletionRequest, body)


def test_body_that_is_not_an_object_is_rejected():
    message = validation_message(CompletionRequest, ["prompt"])
    assert message == "body: must be a JSON object"  # no pydantic class name


def test_completion_request_fills_params_and_takes_the_off_values():
    request = CompletionRequest.model_validate(
        {
            "prompt": "hello",
            "model": "m",
            "temperature": 0,
            "top_k": 5,
            "stop": ["\n\n"],
            "seed": 1234,
            "ignore_eos": True,
            # Unimplemented fields at the value that asks for nothing: served.
            "best_of": 1,
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "logit_bias": {},
            "echo": False,
            "user": "lm_eval",
        }
    )
    assert request.prompts() == ["hello"]
    params = SamplingParams(**request.sampling_kwargs(default_max_tokens=77))
    assert params.max_tokens == 77
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 5, 1.0)
    assert params.stop == ["\n\n"] and params.seed == 1234 and params.ignore_eos


def test_penalties_bias_and_token_stops_fill_params():
    fields = {"frequency_penalty": 0.5, "presence_penalty": -1, "min_tokens": 2}
    fields |= {"repetition_penalty": 1.1, "logit_bias": {"5": -100, "7": 3}}
    request = CompletionRequest.model_validate(
        {"prompt": "hi", "stop_token_ids": [9], **fields}
    )
    params = SamplingParams(**request.sampling_kwargs(default_max_tokens=4))
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, -1.0)
    assert params.repetition_penalty == 1.1 and params.min_tokens == 2
    assert params.logit_bias == {5: -100.0, 7: 3.0}
    assert params.stop_token_ids == [9] and params.adjusts_logits
    assert not SamplingParams(frequency_penalty=0, logit_bias={}).adjusts_logits


@pytest.mark.parametrize(
    "model, field, value",
    [
        (CompletionRequest, "suffix", ""),
        (ChatCompletionRequest, "tools", []),
        (ChatCompletionRequest, "tool_choice", "auto"),
        (ChatCompletionRequest, "response_format", {"type": "json_object"}),
        (ChatCompletionRequest, "reasoning_effort", "low"),
    ],
)
def test_unimplemented_field_is_refused_by_name(model, field, value):
    body = {"prompt": "hi", field: value}
    assert validation_message(model, body).startswith(f"{field}: {field} is not")


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"prompt": "hi", "best_of_n": 3}, "best_of_n: unknown field"),
        ({"prompt": "hi", "stream_options": {"x": 1}}, "stream_options.x: unknown"),
        ({"prompt": 12}, "prompt: Input should be a valid string or"),
        ({"prompt": "hi", "stop": 5}, "stop: Input should be a valid string or"),
    ],
)
def test_messages_name_fields_without_pydantic_internals(body, expected):
    message = validation_message(CompletionRequest, body)
    assert message.startswith(expected)
    for internal in ("Value error", "list[", "str]", "Request", "pydantic"):
        assert internal not in message


def test_max_completion_tokens_wins_over_max_tokens():
    request = CompletionRequest.model_validate(
        {"prompt": "x", "max_tokens": 10, "max_completion_tokens": 3}
    )
    assert request.sampling_kwargs(default_max_tokens=100)["max_tokens"] == 3
    only_old = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 10})
    assert only_old.sampling_kwargs(default_max_tokens=100)["max_tokens"] == 10


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("a", ["a"]),
        ([5, 6, 7], [[5, 6, 7]]),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt, prompts):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == prompts


def test_stream_usage_option():
    plain = CompletionRequest.model_validate({"prompt": "a", "stream": True})
    assert plain.stream and not plain.include_usage_in_stream()
    with_usage = CompletionRequest.model_validate(
        {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}}
    )
    assert with_usage.include_usage_in_stream()


def test_chat_messages_and_prompt_alias():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},  # fmt: skip
            ],
            "chat_template_kwargs": {"thinking": False},
        }
    )
    assert request.chat_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
    ]
    alias = ChatCompletionRequest.model_validate({"prompt": "hello"})
    assert alias.chat_messages() == [{"role": "user", "content": "hello"}]


def test_chat_without_messages_or_with_images_is_a_value_error():
    with pytest.raises(ValueError, match="messages: field required"):
        ChatCompletionRequest.model_validate({"max_tokens": 3}).chat_messages()
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [image]}]}
    )
    with pytest.raises(ValueError, match="only text content parts"):
        request.chat_messages()


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"messages": "hi"}, "messages: Input should be a valid list"),
        ({"messages": [{"content": "hi"}]}, "messages.0.role: Field required"),
        ({"messages": [], "top_logprobs": 1}, "top_logprobs needs logprobs: true"),
        ({"messages": [], "n": 0}, "n: Input should be greater than or equal to 1"),
    ],
)
def test_chat_request_errors_name_the_field(body, expected):
    assert expected in validation_message(ChatCompletionRequest, body)


def test_sampling_params_reject_values_pydantic_lets_through():
    request = CompletionRequest.model_validate({"prompt": "x", "top_p": 1.5})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(**request.sampling_kwargs(default_max_tokens=8))
