"""A KV cache too small for the running requests preempts and recomputes them, and
the greedy tokens stay those of a cache with room for everything."""

from __future__ import annotations

import random

import pytest

from atom import LLMEngine, SamplingParams
from tests.e2e.engine_helpers import BLOCK_SIZE, ENGINE_SETTINGS, random_tokens

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MAX_MODEL_LEN = 128
# One sequence of MAX_MODEL_LEN needs 8 blocks; four growing to 5 blocks need 20.
TINY_CACHE_BLOCKS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _prompts() -> list[list[int]]:
    # Shared prefixes, so a preempted request may resume from a prefix-cache hit.
    rng = random.Random(7)
    shared = random_tokens(rng, 2 * BLOCK_SIZE)
    return [
        shared + random_tokens(rng, 8),
        random_tokens(rng, 40),
        shared + random_tokens(rng, 9),
        shared[:BLOCK_SIZE] + random_tokens(rng, 30),
    ]


def generate(
    model: str, pp: int, num_blocks: int | None, run_ahead: bool = False
) -> tuple[list, dict]:
    settings = {**ENGINE_SETTINGS, "max_model_len": MAX_MODEL_LEN}
    engine = LLMEngine(
        model,
        pipeline_parallel_size=pp,
        num_kvcache_blocks=num_blocks,
        async_scheduling=run_ahead,
        **settings,
    )
    try:
        outs = engine.generate(_prompts(), GREEDY)
        return [out["token_ids"] for out in outs], engine.get_stats()
    finally:
        engine.close()


def check_preemption(model: str, pp: int, run_ahead: bool = False) -> None:
    roomy, roomy_stats = generate(model, 1, None)
    assert roomy_stats["preemptions"] == 0
    tight, stats = generate(model, pp, TINY_CACHE_BLOCKS, run_ahead)
    assert stats["kv_cache_blocks_total"] == TINY_CACHE_BLOCKS
    assert stats["preemptions"] > 0, "the tiny cache never preempted"
    for i, (got, want) in enumerate(zip(tight, roomy)):
        assert got == want, f"{model} pp{pp}: request {i} changed after preemption"


@pytest.mark.parametrize("model", ["tiny-kimi-k3", "tiny-kimi-linear"])
def test_preemption_keeps_greedy_tokens(model):
    check_preemption(model, 1)


@pytest.mark.slow
def test_preemption_with_batches_in_flight_keeps_greedy_tokens():
    """Under pp2 a preempted request may still have a batch in flight."""
    check_preemption("tiny-kimi-k3", 2)


def test_preemption_under_async_scheduling_keeps_greedy_tokens():
    """A preempted sequence may have a run-ahead row in flight, writing blocks and
    a state slot that the scheduler has already handed on (model_engine/run_ahead.py).
    """
    check_preemption("tiny-kimi-k3", 1, run_ahead=True)
