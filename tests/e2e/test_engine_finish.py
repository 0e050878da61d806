"""How requests finish: stop strings, the checkpoint's EOS token, max_tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from atom import LLMEngine, SamplingParams
from atom.models.tiny import resolve_model_path
from tests.e2e.engine_helpers import ENGINE_SETTINGS

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "tiny-kimi-linear"
PROMPT = "hello world"
MAX_TOKENS = 16


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(MODEL, **ENGINE_SETTINGS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def full(engine) -> dict:
    out = engine.generate([PROMPT], greedy(ignore_eos=True))[0]
    assert out["finish_reason"] == "length"
    return out


def first_unique_substring(text: str, start: int, length: int) -> tuple[str, int]:
    """A printable substring that first occurs at or after `start`."""
    for at in range(start, len(text) - length):
        piece = text[at : at + length]
        if piece.isprintable() and "\ufffd" not in piece and text.find(piece) == at:
            return piece, at
    raise AssertionError(f"no usable stop string in {text!r}")


def test_max_tokens_finishes_with_length(engine, full):
    short = engine.generate([PROMPT], greedy(max_tokens=3, ignore_eos=True))[0]
    assert short["finish_reason"] == "length"
    assert short["token_ids"] == full["token_ids"][:3]


def test_stop_string_cuts_the_text_and_finishes_with_stop(engine, full):
    stop, at = first_unique_substring(full["text"], 4, 2)
    out = engine.generate([PROMPT], greedy(stop=["never", stop], ignore_eos=True))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == full["text"][:at]
    assert len(out["token_ids"]) < MAX_TOKENS
    assert out["token_ids"] == full["token_ids"][: len(out["token_ids"])]


def test_stop_string_in_a_batch_finishes_only_its_request(engine, full):
    stop, at = first_unique_substring(full["text"], 4, 2)
    outs = engine.generate(
        [PROMPT, PROMPT], [greedy(stop=stop, ignore_eos=True), greedy(ignore_eos=True)]
    )
    assert [o["finish_reason"] for o in outs] == ["stop", "length"]
    assert outs[0]["text"] == full["text"][:at]
    assert outs[1]["token_ids"] == full["token_ids"]


def test_eos_token_finishes_with_stop(full, tmp_path):
    """The same checkpoint with eos_token_id set to its 4th greedy token."""
    tokens = full["token_ids"]
    eos = next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    at = tokens.index(eos)
    source = Path(resolve_model_path(MODEL))
    for item in source.iterdir():
        if item.name != "config.json":
            os.symlink(item, tmp_path / item.name)
    config = json.loads((source / "config.json").read_text())
    config["eos_token_id"] = eos
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = LLMEngine(str(tmp_path), **ENGINE_SETTINGS)
    try:
        stopped, ignored = engine.generate(
            [PROMPT, PROMPT], [greedy(), greedy(ignore_eos=True)]
        )
    finally:
        engine.close()
    assert stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == tokens[: at + 1]
    assert ignored["finish_reason"] == "length"
    assert ignored["token_ids"] == tokens


def outputs_until_finished(engine: LLMEngine, request_id: str) -> list:
    outputs = []
    while not (outputs and outputs[-1].finished):
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_a_final_only_request_yields_one_output_with_the_streamed_text(engine, full):
    streamed_id = engine.add_request(PROMPT, greedy(ignore_eos=True))
    streamed = outputs_until_finished(engine, streamed_id)
    final_id = engine.add_request(PROMPT, greedy(ignore_eos=True), final_only=True)
    final = outputs_until_finished(engine, final_id)
    assert len(streamed) == MAX_TOKENS
    assert len(final) == 1
    assert final[0].text == "".join(o.new_text for o in streamed) == full["text"]
    assert final[0].output_token_ids == full["token_ids"]


def test_a_final_only_request_still_stops_at_its_stop_string(engine, full):
    stop, at = first_unique_substring(full["text"], 4, 2)
    params = greedy(stop=[stop], ignore_eos=True)
    request_id = engine.add_request(PROMPT, params, final_only=True)
    final = outputs_until_finished(engine, request_id)
    assert final[-1].finish_reason == "stop"
    assert final[-1].text == full["text"][:at]
