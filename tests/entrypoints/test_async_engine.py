"""One request's failure fails that request only: the engine loop goes on.

The failures are real objects passed through the public API (a prompt that cannot
be read, a stop string whose check raises); engine and model are the real ones.
"""

import asyncio
import logging
import threading

import pytest

from atom import LLMEngine, SamplingParams
from atom.entrypoints.openai.api_error import error_for
from atom.entrypoints.openai.async_engine import (
    LARGE_TEXT_CHARS,
    AsyncEngine,
    RequestFailedError,
)

SETTINGS = dict(device="cpu", max_model_len=128, max_num_seqs=8, block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class UnreadablePrompt(list):
    """Token ids that raise when the engine reads them (while adding the request)."""

    def __iter__(self):
        raise RuntimeError("cannot read this prompt")


class ExplodingStop(str):
    """A stop string whose length cannot be taken (in the stop-string check)."""

    def __len__(self):
        raise RuntimeError("stop string exploded")


def exploding_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=5, stop=[ExplodingStop("zz")])


@pytest.fixture(scope="module")
def engine(single_thread_torch):
    engine = LLMEngine("tiny-kimi-k3", **SETTINGS)
    yield engine
    engine.close()


def test_failed_stop_check_fails_only_its_request(engine):
    with pytest.raises(RuntimeError, match="stop string exploded"):
        engine.generate([[5, 6, 7], [8, 9]], [GREEDY, exploding_params()])
    assert not engine.has_unfinished_requests()
    (result,) = engine.generate([[5, 6, 7]], GREEDY)
    assert len(result["token_ids"]) == 5


def test_async_engine_survives_requests_that_fail(single_thread_torch):
    async_engine = AsyncEngine(lambda: LLMEngine("tiny-kimi-k3", **SETTINGS)).start()
    try:

        async def final(prompt, params):
            last = None
            async for output in async_engine.generate(prompt, params):
                last = output
            return last

        async def drive():
            return await asyncio.gather(
                final([5, 6, 7], GREEDY),
                final(UnreadablePrompt([5, 6]), GREEDY),
                final("a prompt", exploding_params()),
                final("another prompt", GREEDY),
                return_exceptions=True,
            )

        good, unreadable, exploded, good_text = asyncio.run(drive())
        assert len(good.output_token_ids) == 5 and good.finish_reason == "length"
        assert len(good_text.output_token_ids) == 5
        assert isinstance(unreadable, RuntimeError)
        assert "cannot read this prompt" in str(unreadable)
        assert isinstance(exploded, RequestFailedError)
        assert async_engine.is_healthy
        again = asyncio.run(final([5, 6, 7], GREEDY))
        assert again.output_token_ids == good.output_token_ids
    finally:
        async_engine.shutdown()


def test_unexpected_error_answers_an_id_and_logs_the_traceback(caplog):
    try:
        raise KeyError("/very/private/path/secret.py")
    except KeyError as error:
        with caplog.at_level(logging.ERROR):
            failure = error_for(error)
    assert failure.status == 500 and failure.kind == "internal_error"
    assert "\n" not in failure.message and "private" not in failure.message
    error_id = failure.message.split()[2]
    assert error_id.startswith("error-")
    (record,) = [r for r in caplog.records if error_id in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is KeyError


class GatedTokenizer:
    """Encodes a large text only once `release` is set, counting how many at once."""

    def __init__(self):
        self.release = threading.Event()
        self.large_at_once = 0
        self.most_large_at_once = 0
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > LARGE_TEXT_CHARS:
            with self._lock:
                self.large_at_once += 1
                self.most_large_at_once = max(
                    self.most_large_at_once, self.large_at_once
                )
            self.release.wait()
            with self._lock:
                self.large_at_once -= 1
        return [len(text)]


def test_large_texts_queue_in_their_own_lane():
    # Not started: encode() and prepare() need no engine, only the tokenizer.
    async_engine = AsyncEngine(lambda: None)
    tokenizer = GatedTokenizer()
    async_engine.tokenizer = tokenizer
    large = "x" * (LARGE_TEXT_CHARS + 1)

    async def drive():
        bigs = [asyncio.ensure_future(async_engine.encode(large)) for _ in range(3)]
        try:
            # Every preparation thread is still free for the small requests.
            small = await asyncio.wait_for(
                asyncio.gather(
                    async_engine.encode("small"),
                    async_engine.prepare(len, "parsed"),
                    async_engine.encode("small too"),
                ),
                timeout=30,
            )
            assert small == [[5], 6, [9]]
            assert not any(big.done() for big in bigs)
        finally:
            tokenizer.release.set()
        return await asyncio.gather(*bigs)

    assert asyncio.run(drive()) == [[LARGE_TEXT_CHARS + 1]] * 3
    assert tokenizer.most_large_at_once == 1
