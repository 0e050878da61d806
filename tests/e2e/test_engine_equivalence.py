"""The engine's greedy tokens are the golden model's at every pp x tp layout.

Each test starts one engine (the expensive part) and runs every prompt set through it:
a batch of 16 prompts of mixed lengths (shared prefixes, several blocks, split into
chunks of 32 tokens), then a batch-1 run whose prompt hits the prefix cache, then a
seeded sampled batch that must repeat the in-process (pp1/tp1) engine's tokens.
"""

from __future__ import annotations

import random
import time

import pytest

from atom import LLMEngine, SamplingParams
from tests.e2e.engine_helpers import (
    BLOCK_SIZE,
    ENGINE_SETTINGS,
    GoldenOracle,
    random_tokens,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _sampled(seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        max_tokens=NEW_TOKENS,
        ignore_eos=True,
        seed=seed,
    )


def _prompts() -> tuple[list[list[int]], list[int]]:
    """(batch of 16, batch-1 prompt). A hybrid model resumes a prefix only from the
    KDA state saved at an earlier prompt's last full block, so hits come from prompts
    that end their full blocks where a later prompt's shared prefix does."""
    rng = random.Random(2024)
    shared = random_tokens(rng, 3 * BLOCK_SIZE)
    batch = [
        shared + random_tokens(rng, 5),  # saves the state after 3 shared blocks
        random_tokens(rng, 1),
        shared[:40] + random_tokens(rng, 9),
        random_tokens(rng, 33),
        shared + random_tokens(rng, 30),  # hits 3 blocks, then two more chunks
        shared[:20] + random_tokens(rng, 2),
        random_tokens(rng, 7),
        shared[: 2 * BLOCK_SIZE],  # exactly two blocks
        random_tokens(rng, BLOCK_SIZE),  # exactly one block
        shared + random_tokens(rng, 17),
        random_tokens(rng, 64),
        shared[:40] + random_tokens(rng, 24),
        random_tokens(rng, 3),
        shared[:17],
        random_tokens(rng, 45),
    ]
    batch.append(list(batch[0]))  # a repeated prompt
    return batch, shared + random_tokens(rng, 12)


BATCH_PROMPTS, SINGLE_PROMPT = _prompts()
# Two requests share prompt and seed (so must agree); the others differ in both.
SAMPLED_PROMPTS = [BATCH_PROMPTS[0], BATCH_PROMPTS[0], BATCH_PROMPTS[3], SINGLE_PROMPT]
SAMPLED_PARAMS = [_sampled(11), _sampled(11), _sampled(12), _sampled(13)]


def run_all_cases(
    model: str, pp: int, tp: int, prefix_caching: bool
) -> dict[str, object]:
    """Every prompt set through one engine of this layout."""
    started = time.monotonic()
    engine = LLMEngine(
        model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enable_prefix_caching=prefix_caching,
        **ENGINE_SETTINGS,
    )
    try:
        ready = time.monotonic()
        batch = engine.generate(BATCH_PROMPTS, GREEDY)
        single = engine.generate([SINGLE_PROMPT], GREEDY)
        sampled = engine.generate(SAMPLED_PROMPTS, SAMPLED_PARAMS)
        stats = engine.get_stats()
    finally:
        engine.close()
    print(
        f"{model} pp{pp}/tp{tp} prefix={prefix_caching}: start-up "
        f"{ready - started:.1f} s, generation {time.monotonic() - ready:.1f} s"
    )
    return {
        "batch": [out["token_ids"] for out in batch],
        "single": single[0]["token_ids"],
        "sampled": [out["token_ids"] for out in sampled],
        "reasons": {out["finish_reason"] for out in batch + single + sampled},
        "stats": stats,
    }


@pytest.fixture(scope="module")
def sampled_reference():
    """Seeded sampled tokens of the in-process pp1/tp1 engine, per model."""
    cache: dict[str, list[list[int]]] = {}

    def reference(model: str) -> list[list[int]]:
        if model not in cache:
            engine = LLMEngine(model, **ENGINE_SETTINGS)
            try:
                outs = engine.generate(SAMPLED_PROMPTS, SAMPLED_PARAMS)
            finally:
                engine.close()
            cache[model] = [out["token_ids"] for out in outs]
        return cache[model]

    return reference


def check_layout(
    oracle: GoldenOracle,
    sampled_reference,
    model: str,
    pp: int,
    tp: int,
    prefix_caching: bool,
) -> None:
    got = run_all_cases(model, pp, tp, prefix_caching)
    where = f"{model} pp{pp}/tp{tp} prefix_caching={prefix_caching}"
    prompts = BATCH_PROMPTS + [SINGLE_PROMPT]
    for i, (prompt, tokens) in enumerate(zip(prompts, got["batch"] + [got["single"]])):
        golden = oracle.continuation(model, prompt, NEW_TOKENS)
        assert tokens == golden, (
            f"{where}: prompt {i} ({len(prompt)} tokens) gave {tokens}, "
            f"golden greedy {golden}"
        )
    assert got["reasons"] == {"length"}
    hits = got["stats"]["prefix_cache_hit_tokens"]
    if prefix_caching:
        assert hits > 0, f"{where}: the prefix cache never hit"
    else:
        assert hits == 0, f"{where}: {hits} prefix-cache hit tokens with caching off"
    sampled = got["sampled"]
    assert sampled[0] == sampled[1], f"{where}: one seed gave two continuations"
    assert sampled[0] != got["batch"][0], f"{where}: temperature 0.8 sampled greedily"
    reference = sampled_reference(model)
    assert sampled == reference, f"{where}: seeded sampling differs from pp1/tp1"


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("model", ["tiny-kimi-k3", "tiny-kimi-linear"])
def test_pp1_tp1_matches_golden(
    golden_oracle, sampled_reference, model, prefix_caching
):
    check_layout(golden_oracle, sampled_reference, model, 1, 1, prefix_caching)


MULTI_PROCESS = [
    # (model, pp, tp, prefix caching). TP 4 runs once, in the reference layout
    # (pp2 x tp4) of the model that has every layer kind; eight rank processes on
    # a two-core CI machine take half a minute a layout.
    *[(m, pp, tp, True) for m in ("tiny-kimi-k3", "tiny-kimi-linear")
      for pp, tp in ((1, 2), (2, 1), (2, 2))],
    ("tiny-kimi-k3", 2, 4, True),
    ("tiny-kimi-k3", 2, 2, False),
    ("tiny-kimi-linear", 1, 2, False),
    ("tiny-kimi-k31", 2, 2, True),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,pp,tp,prefix_caching",
    MULTI_PROCESS,
    ids=[f"{m}-pp{pp}-tp{tp}-prefix{int(p)}" for m, pp, tp, p in MULTI_PROCESS],
)
def test_multi_process_layout_matches_golden(
    golden_oracle, sampled_reference, model, pp, tp, prefix_caching
):
    check_layout(golden_oracle, sampled_reference, model, pp, tp, prefix_caching)
