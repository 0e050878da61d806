"""`--tokenizer PATH` and `--skip-tokenizer-init` through `LLMEngine`, `atom generate`
and `atom serve`, on a model folder that ships no tokenizer files."""

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from atom import LLMEngine, SamplingParams
from atom.entrypoints.cli import main as atom_main
from atom.entrypoints.cli import make_parser
from atom.entrypoints.openai.api_server import build_app
from atom.entrypoints.openai.async_engine import AsyncEngine
from atom.model_engine.arg_utils import EngineArgs
from atom.models.tiny import resolve_model_path

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "tiny-kimi-linear"
ENGINE = dict(device="cpu", max_model_len=64, max_num_seqs=2)
PROMPT = [5, 77, 301, 9, 640, 12]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def bare_folder(tmp_path_factory) -> str:
    """tiny-kimi-linear without its tokenizer files."""
    source = resolve_model_path(MODEL)
    folder = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(f"{source}/{name}", folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def skipping_engine(bare_folder):
    engine = LLMEngine(bare_folder, skip_tokenizer_init=True, **ENGINE)
    yield engine
    engine.close()


def test_a_folder_without_tokenizer_fails_at_start_up(bare_folder):
    with pytest.raises(ValueError) as error:
        LLMEngine(bare_folder, **ENGINE)
    message = str(error.value)
    assert bare_folder in message
    assert "--tokenizer PATH" in message and "--skip-tokenizer-init" in message


def test_tokenizer_from_elsewhere(bare_folder):
    engine = LLMEngine(bare_folder, tokenizer=resolve_model_path(MODEL), **ENGINE)
    try:
        (by_text,) = engine.generate(["The quick brown fox"], GREEDY)
        (by_ids,) = engine.generate([PROMPT], GREEDY)
    finally:
        engine.close()
    assert by_text["text"] and len(by_text["token_ids"]) == 4
    assert len(by_ids["token_ids"]) == 4


def test_tokenizer_path_must_hold_a_tokenizer(bare_folder):
    with pytest.raises(ValueError, match="holds no tokenizer files"):
        LLMEngine(bare_folder, tokenizer=bare_folder, **ENGINE)
    with pytest.raises(ValueError, match="exclude each other"):
        LLMEngine(
            bare_folder,
            tokenizer=resolve_model_path(MODEL),
            skip_tokenizer_init=True,
            **ENGINE,
        )


def test_skip_tokenizer_init_takes_and_returns_ids(skipping_engine):
    (result,) = skipping_engine.generate([PROMPT], GREEDY)
    assert result["text"] == "" and len(result["token_ids"]) == 4
    assert skipping_engine.tokenizer is None


def test_skip_tokenizer_init_matches_the_tokenized_engine(skipping_engine):
    """Same weights, same ids: the tokenizer changes nothing but the text."""
    engine = LLMEngine(MODEL, **ENGINE)
    try:
        (expected,) = engine.generate([PROMPT], GREEDY)
    finally:
        engine.close()
    (result,) = skipping_engine.generate([PROMPT], GREEDY)
    assert result["token_ids"] == expected["token_ids"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e: e.add_request("hello", GREEDY), "text prompts need a tokenizer"),
        (
            lambda e: e.add_request(PROMPT, SamplingParams(stop=["x"])),
            "stop strings need a tokenizer",
        ),
        (
            lambda e: e.apply_chat_template([{"role": "user", "content": "hi"}]),
            "chat messages need a tokenizer",
        ),
    ],
)
def test_skip_tokenizer_init_refuses_text(skipping_engine, call, message):
    with pytest.raises(ValueError, match=message):
        call(skipping_engine)
    assert not skipping_engine.has_unfinished_requests()


# ---- atom generate ----


def test_generate_without_tokenizer_prints_ids(bare_folder, capsys):
    atom_main(
        [
            "generate",
            "--model",
            bare_folder,
            "--skip-tokenizer-init",
            "--prompt",
            "5 77 301",
            "--prompt",
            "9,640,12",
            "--max-tokens",
            "3",
            "--device",
            "cpu",
            "--max-model-len",
            "64",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Prompt: [5, 77, 301]"
    completions = [json.loads(line.split(": ", 1)[1]) for line in lines[1:4:2]]
    assert len(completions) == 2 and all(len(ids) == 3 for ids in completions)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--skip-tokenizer-init", "--prompt", "hello"], "token-id prompts"),
        (["--skip-tokenizer-init"], "give token-id prompts"),
    ],
)
def test_generate_without_tokenizer_refuses_text_prompts(bare_folder, flags, message):
    with pytest.raises(SystemExit, match=message):
        atom_main(["generate", "--model", bare_folder, "--device", "cpu", *flags])


def test_generate_without_tokenizer_or_flags_names_both_flags(bare_folder):
    with pytest.raises(SystemExit) as error:
        atom_main(["generate", "--model", bare_folder, "--device", "cpu"])
    message = str(error.value.code)
    assert message.startswith("atom generate: error: ")
    assert bare_folder in message and "--skip-tokenizer-init" in message
    assert "--tokenizer PATH" in message


# ---- atom serve ----


def serve_args(*flags: str) -> EngineArgs:
    args = make_parser().parse_args(["serve", *flags])
    return EngineArgs.from_cli_args(args)


@pytest.fixture(scope="module")
def client(bare_folder):
    engine_args = serve_args(
        "--model", bare_folder, "--skip-tokenizer-init", "--device", "cpu",
        "--max-model-len", "64", "--max-num-seqs", "2",
    )  # fmt: skip
    async_engine = AsyncEngine(engine_args.create_engine).start()
    try:
        with TestClient(build_app(async_engine, stats_log_interval_s=0)) as client:
            yield client
    finally:
        async_engine.shutdown()


def test_serve_returns_token_ids(client, skipping_engine):
    (expected,) = skipping_engine.generate([PROMPT], GREEDY)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["text"] == "" and choice["token_ids"] == expected["token_ids"]


def test_serve_streams_token_ids(client, skipping_engine):
    (expected,) = skipping_engine.generate([PROMPT], GREEDY)
    body = {
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        frames = [line[len("data: ") :] for line in response.iter_lines() if line]
    assert frames[-1] == "[DONE]"
    ids = [i for f in frames[:-1] for i in json.loads(f)["choices"][0]["token_ids"]]
    assert ids == expected["token_ids"]


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {"prompt": "hello"}, "text prompts need a tokenizer"),
        (
            "/v1/completions",
            {"prompt": "hello", "stream": True},
            "text prompts need a tokenizer",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}]},
            "chat messages need a tokenizer",
        ),
    ],
)
def test_serve_refuses_text_with_a_reason(client, path, body, message):
    response = client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]["message"]
    assert message in error and "--skip-tokenizer-init" in error


def test_serve_without_tokenizer_or_flags_fails_at_start_up(bare_folder):
    engine_args = serve_args("--model", bare_folder, "--device", "cpu")
    with pytest.raises(ValueError) as error:
        AsyncEngine(engine_args.create_engine).start()
    message = str(error.value)
    assert bare_folder in message and "--tokenizer PATH" in message
    assert "--skip-tokenizer-init" in message
