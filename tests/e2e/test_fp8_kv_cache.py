"""--kv-cache-dtype fp8 end to end on the trained tiny Kimi-K3: greedy DSpark stays
lossless over an fp8 cache, and the pipeline x tensor split does not change a token.

Rows are quantized per layer with a fixed scale, so a TP rank stores exactly the
rows the single process stores (the MLA latent rows are replicated), and the
reference for pp2 x tp2 is pp1 x tp1.
"""

from __future__ import annotations

import pytest

from tests.e2e.pp_probe import (
    PAIRS,
    acceptance,
    corpus_prompts,
    generate_ids,
    make_engine,
)

TARGET, DRAFT = PAIRS["k3"]
PROMPTS = corpus_prompts()
# The shipped draft at pp1 over a model-dtype cache accepts ~0.5
# (docs/accuracy.md); context rows broken by fp8 would fall far below.
MIN_ACCEPTANCE = 0.25

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def fp8_kv_ids(
    draft: str | None = None, target: str = TARGET, rounds: int = 1, **layout
) -> tuple[list[list[int]], float]:
    """Greedy ids of PROMPTS; with `rounds` > 1 the engine serves them again from
    its prefix cache (fp8 blocks reused as stored) and must repeat every token."""
    engine = make_engine(target, draft, kv_cache_dtype="fp8", **layout)
    try:
        ids = generate_ids(engine, PROMPTS)
        for _ in range(rounds - 1):
            hits = engine.get_stats()["prefix_cache_hit_tokens"]
            assert generate_ids(engine, PROMPTS) == ids
            assert engine.get_stats()["prefix_cache_hit_tokens"] > hits
        return ids, acceptance(engine) if draft else 0.0
    finally:
        engine.close()


def test_dspark_over_an_fp8_kv_cache_gives_the_target_only_tokens():
    target_only, _ = fp8_kv_ids(enable_prefix_caching=False)
    speculated, accepted = fp8_kv_ids(DRAFT, rounds=2)
    assert speculated == target_only
    assert accepted >= MIN_ACCEPTANCE


def test_minimax_gqa_rows_and_its_qwen3_draft_run_over_an_fp8_kv_cache():
    """The GQA [k | v | index key] rows and the draft's [k | v] context rows. The
    weights are random, so logits are nearly tied and a verify's rows may attend
    apart from a one-row decode: only the prefill's token is compared."""
    target_only, _ = fp8_kv_ids(target="tiny-minimax-m3")
    speculated, _ = fp8_kv_ids("tiny-minimax-m3-dspark", target="tiny-minimax-m3")
    assert [ids[:1] for ids in speculated] == [ids[:1] for ids in target_only]
    assert [len(ids) for ids in speculated] == [len(ids) for ids in target_only]


@pytest.mark.slow
def test_pp2_tp2_dspark_over_an_fp8_kv_cache_matches_pp1_target_only():
    reference, _ = fp8_kv_ids(enable_prefix_caching=False)
    split, accepted = fp8_kv_ids(
        DRAFT, pipeline_parallel_size=2, tensor_parallel_size=2
    )
    assert split == reference
    assert accepted >= MIN_ACCEPTANCE
