"""What the real server does with each OpenAI request field: honoured or refused.

The server runs with a small context (MAX_MODEL_LEN) so that a request that used to
be clamped to it, instead of refused, finishes quickly and fails the test.
"""

import json

import pytest
from tokenizers import Tokenizer

from atom.models.tiny.tokenizer import TOKENIZER_FILE
from tests.entrypoints.server_helpers import Server

MODEL = "tiny-kimi-k3"
MAX_MODEL_LEN = 64
PROMPT_IDS = [5, 6, 7]
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OVER_THE_CONTEXT = [5000, 10**12, 2**63]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("fields") / "server.log"
    flags = ["--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN)]
    running = Server(flags, log_path).wait_healthy()
    yield running
    running.stop()


def error_message(response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"]
    return error["message"]


def request(path: str, **fields) -> dict:
    if path == COMPLETIONS:
        return {"prompt": PROMPT_IDS, "max_tokens": 2} | fields
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields


@pytest.mark.parametrize("max_tokens", OVER_THE_CONTEXT)
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_beyond_the_context_is_400_with_both_numbers(
    server, max_tokens, stream
):
    body = request(COMPLETIONS, max_tokens=max_tokens, stream=stream)
    message = error_message(server.post(COMPLETIONS, body), 400)
    assert f"prompt of {len(PROMPT_IDS)} tokens" in message
    assert f"max_tokens={max_tokens}" in message
    assert f"max_model_len={MAX_MODEL_LEN}" in message
    chat = request(CHAT, max_completion_tokens=max_tokens, stream=stream)
    message = error_message(server.post(CHAT, chat), 400)
    assert f"max_tokens={max_tokens}" in message
    assert f"max_model_len={MAX_MODEL_LEN}" in message
    assert server.get("/health").json() == {"status": "ok"}


def test_a_request_that_just_fits_is_served_and_one_more_is_not(server):
    room = MAX_MODEL_LEN - len(PROMPT_IDS)
    fits = request(COMPLETIONS, max_tokens=room, ignore_eos=True, temperature=0)
    response = server.post(COMPLETIONS, fits)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == room
    too_many = server.post(COMPLETIONS, fits | {"max_tokens": room + 1})
    assert f"ask for at most {room} tokens" in error_message(too_many, 400)
    long_prompt = {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1}
    message = error_message(server.post(COMPLETIONS, long_prompt), 400)
    assert f"prompt of {MAX_MODEL_LEN} tokens" in message


def test_chat_without_max_tokens_fills_the_rest_of_the_context(server):
    body = request(CHAT, ignore_eos=True, temperature=0)
    del body["max_tokens"]
    response = server.post(CHAT, body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    assert response.json()["choices"][0]["finish_reason"] == "length"


# (endpoint, field, value): each asks for something atom does not do, or is out
# of the field's range.
REFUSED = [
    (COMPLETIONS, "frequency_penalty", 2.5),  # out of OpenAI's [-2, 2]
    (CHAT, "presence_penalty", False),
    (COMPLETIONS, "logit_bias", {"five": 1}),
    (CHAT, "logit_bias", {"5": 101}),
    (COMPLETIONS, "logit_bias", {"999999": 1}),  # outside the vocabulary
    (COMPLETIONS, "min_tokens", -1),
    (CHAT, "repetition_penalty", 0),
    (COMPLETIONS, "stop_token_ids", 3),  # not a list
    (COMPLETIONS, "best_of", 0),
    (COMPLETIONS, "best_of", 129),
    (COMPLETIONS, "suffix", " the end"),
    (COMPLETIONS, "logprobs", 21),
    (COMPLETIONS, "logprobs", True),
    (COMPLETIONS, "echo", 1),  # not a boolean
    (CHAT, "logprobs", 1),
    (CHAT, "top_logprobs", 2),  # without logprobs: true
    (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (CHAT, "tool_choice", "auto"),
    (CHAT, "response_format", {"type": "json_object"}),
    (CHAT, "reasoning_effort", "low"),
    (COMPLETIONS, "made_up_field", 1),
    (CHAT, "made_up_field", None),
]


@pytest.mark.parametrize("path, field, value", REFUSED)
def test_a_field_atom_does_not_honour_is_400_naming_it(server, path, field, value):
    message = error_message(server.post(path, request(path, **{field: value})), 400)
    assert message.startswith(f"{field}: "), message
    for internal in ("pydantic", "errors.pydantic.dev", "Value error", "Request"):
        assert internal not in message


def test_a_message_key_with_a_value_is_refused_and_an_empty_one_served(server):
    named = {"role": "user", "content": "hi", "name": "bob"}
    body = request(CHAT) | {"messages": [named]}
    message = error_message(server.post(CHAT, body), 400)
    assert message.startswith("messages.0: message keys ['name']"), message
    replayed = {"role": "assistant", "content": "hello", "tool_calls": None}
    replayed |= {"refusal": None}
    user = {"role": "user", "content": "and?"}
    body = request(CHAT) | {"messages": [user, replayed, user]}
    response = server.post(CHAT, body)
    assert response.status_code == 200, response.text


# (endpoint, fields): every honoured field, or an unimplemented one at the value
# that asks for nothing, as clients send by default.
SERVED = [
    (COMPLETIONS, {"model": MODEL, "temperature": 0.5, "top_p": 0.9, "top_k": 5}),
    (COMPLETIONS, {"stop": ["\n"], "seed": 3, "ignore_eos": True, "n": 1}),
    (COMPLETIONS, {"max_completion_tokens": 2, "user": "someone"}),
    (COMPLETIONS, {"frequency_penalty": 0, "presence_penalty": 0.0}),
    (CHAT, {"frequency_penalty": 1, "presence_penalty": -0.5, "min_tokens": 1}),
    (CHAT, {"repetition_penalty": 1.3, "stop_token_ids": [3], "logit_bias": {}}),
    (COMPLETIONS, {"logit_bias": {}, "best_of": 1, "echo": False}),
    (COMPLETIONS, {"logprobs": None, "suffix": None}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": True}}),
    (CHAT, {"model": MODEL, "temperature": 0, "seed": 1, "stop": "x"}),
    (CHAT, {"logprobs": False, "tools": None, "tool_choice": None}),
    (CHAT, {"response_format": {"type": "text"}, "chat_template_kwargs": {}}),
]


@pytest.mark.parametrize("path, fields", SERVED)
def test_honoured_fields_and_off_values_are_served(server, path, fields):
    response = server.post(path, request(path, **fields))
    assert response.status_code == 200, response.text


def test_logit_bias_bans_and_forces_a_token(server):
    """The server has the tiny tokenizer, so tokens are read back from the text."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))

    def completion(**fields) -> str:
        body = {"prompt": "And God said", "max_tokens": 6, "temperature": 0}
        response = server.post(COMPLETIONS, body | {"ignore_eos": True} | fields)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    plain = completion()
    banned = tokenizer.encode(plain).ids[0]
    assert plain.startswith(tokenizer.decode([banned]))
    without = completion(logit_bias={str(banned): -100})
    assert banned not in tokenizer.encode(without).ids
    forced = tokenizer.encode(" light").ids[0]
    always = completion(logit_bias={str(forced): 100}, temperature=1.0)
    assert always == tokenizer.decode([forced] * 6)


def test_n_choices_are_indexed_seeded_and_summed(server):
    body = {"prompt": ["In the", "And the"], "max_tokens": 5, "temperature": 1.0}
    body |= {"ignore_eos": True, "seed": 7, "n": 3}
    first = server.post(COMPLETIONS, body).json()
    choices = first["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert first["usage"]["completion_tokens"] == 6 * 5
    # Choice 0 is the request with n=1; the others have seeds of their own.
    single = server.post(COMPLETIONS, body | {"prompt": "In the", "n": 1}).json()
    assert single["choices"][0]["text"] == choices[0]["text"]
    assert len({c["text"] for c in choices[:3]}) > 1
    assert server.post(COMPLETIONS, body).json()["choices"] == choices


def test_n_choices_stream_with_their_index(server):
    body = request(CHAT, max_tokens=4, temperature=1.0, seed=3, n=2, ignore_eos=True)
    whole = server.post(CHAT, body).json()
    assert whole["usage"]["completion_tokens"] == 8
    stream = server.post(
        CHAT, body | {"stream": True, "stream_options": {"include_usage": True}}
    )
    frames = [json.loads(f[6:]) for f in stream.text.strip().split("\n\n")[:-1]]
    *chunks, usage = frames
    assert usage["usage"]["completion_tokens"] == 8
    # The prompt counts once, however many choices it has.
    one = server.post(CHAT, body | {"n": 1}).json()["usage"]["prompt_tokens"]
    assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] == one
    for choice in whole["choices"]:
        index = choice["index"]
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == choice["message"]["content"]
        assert [c["finish_reason"] for c in mine][-1] == "length"


def test_logprobs_in_the_openai_shapes(server):
    """Completions: parallel lists with top-k dicts; chat: content entries; a
    stream carries each chunk's tokens. Greedy tokens are their top-1."""
    body = {"prompt": "And God said", "max_tokens": 5, "temperature": 0}
    body |= {"ignore_eos": True, "logprobs": 2}
    choice = server.post(COMPLETIONS, body).json()["choices"][0]
    shaped = choice["logprobs"]
    assert "".join(shaped["tokens"]) == choice["text"]
    assert len(shaped["token_logprobs"]) == 5 and shaped["text_offset"][0] == 0
    for token, logprob, top in zip(
        shaped["tokens"], shaped["token_logprobs"], shaped["top_logprobs"]
    ):
        assert logprob <= 0 and len(top) == 2 and top[token] == logprob
        assert max(top.values()) == logprob
    stream = server.post(COMPLETIONS, body | {"stream": True}).text
    frames = [json.loads(f[6:]) for f in stream.strip().split("\n\n")[:-1]]
    streamed = [
        lp for f in frames for lp in f["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert streamed == pytest.approx(shaped["token_logprobs"])
    chat = request(CHAT, logprobs=True, top_logprobs=3, temperature=0)
    content = server.post(CHAT, chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 3
    first = content[0]
    assert first["top_logprobs"][0]["logprob"] == first["logprob"] <= 0
    assert bytes(first["bytes"]).decode() == first["token"]


def test_best_of_returns_the_likeliest_candidates(server):
    body = {"prompt": "In the", "max_tokens": 4, "temperature": 1.5, "seed": 11}
    body |= {"ignore_eos": True}
    # best_of's candidates are the choices n=best_of gives with the same seed.
    candidates = server.post(COMPLETIONS, body | {"n": 4, "logprobs": 0}).json()
    ranked = sorted(
        candidates["choices"],
        key=lambda c: sum(c["logprobs"]["token_logprobs"]),
        reverse=True,
    )
    best = server.post(COMPLETIONS, body | {"n": 2, "best_of": 4}).json()
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])
    assert best["usage"]["completion_tokens"] == 4 * 4


def test_echo_returns_the_prompt_and_its_logprobs(server):
    """lm-eval's loglikelihood request (echo, max_tokens 0, logprobs): the prompt's
    logprobs, the first null; the next token's logprob, echoed, equals the one it
    got when generated."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))
    prompt = "And God said"
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0}
    generated = server.post(COMPLETIONS, body | {"max_tokens": 1}).json()
    shaped = generated["choices"][0]["logprobs"]
    num_prompt = generated["usage"]["prompt_tokens"]
    assert generated["choices"][0]["text"].startswith(prompt)
    assert shaped["token_logprobs"][0] is None and shaped["top_logprobs"][0] is None
    assert len(shaped["tokens"]) == num_prompt + 1
    assert "".join(shaped["tokens"][:num_prompt]) == prompt
    ids = tokenizer.encode(prompt).ids + tokenizer.encode(shaped["tokens"][-1]).ids
    echoed = server.post(COMPLETIONS, body | {"prompt": ids, "max_tokens": 0}).json()
    choice = echoed["choices"][0]
    assert choice["text"] == prompt + shaped["tokens"][-1]
    assert echoed["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        shaped["token_logprobs"], abs=1e-4
    )
    refused = server.post(COMPLETIONS, body | {"max_tokens": 0, "echo": False})
    assert error_message(refused, 400).startswith("max_tokens: 0 asks for no tokens")


def test_the_official_openai_client_uses_every_new_field(server):
    """n, best_of, logprobs, echo, penalties and logit_bias through `openai`."""
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))
    light = tokenizer.encode(" light").ids[0]
    completion = client.completions.create(
        model=MODEL,
        prompt="And God said",
        max_tokens=3,
        n=2,
        best_of=3,
        logprobs=1,
        echo=True,
        temperature=1.0,
        seed=5,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={str(light): 100},
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.text == "And God said" + " light" * 3
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.tokens[-3:] == [" light"] * 3
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        n=2,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(len(c.logprobs.content) == 2 for c in chat.choices)
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].token
