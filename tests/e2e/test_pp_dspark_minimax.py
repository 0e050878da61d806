"""MiniMax-M3 with its Qwen3 DSpark draft under pipeline x tensor parallelism.

Real rank processes over gloo, the same relay, drafter and proposer as Kimi. Greedy
speculation must equal target-only decoding at pp1; at pp2 x tp2 (and pp2 x tp4,
marked slow) the tokens, every draft each sequence received and the acceptance must
equal pp1's. The trained tiny pair on held-out corpus prompts accepts part of its
drafts, not all, so both acceptance and rejection are exercised. Each stage's memory
ledger must show the embedding on the first stage and exactly one more vocab shard,
the drafter's, on the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from atom.models.tiny.minimax_specs import minimax_text_config
from tests.e2e.pp_probe import (
    Recorder,
    acceptance,
    corpus_prompts,
    embedding_facts,
    generate_ids,
    make_engine,
)

TARGET, DRAFT = "tiny-minimax-m3", "tiny-minimax-m3-dspark"
PROMPTS = corpus_prompts()
TEXT = minimax_text_config()


def shard_bytes(tp: int) -> int:
    """One vocab-parallel fp32 table shard: vocab / tp x hidden x 4 bytes."""
    return TEXT["vocab_size"] // tp * TEXT["hidden_size"] * 4


@dataclass
class Reference:
    ids: list[list[int]]  # pp1 x tp1 without speculation
    drafts: list[list[list[int]]]  # every draft each sequence got at pp1
    acceptance: float


pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(scope="module")
def reference() -> Reference:
    engine = make_engine(TARGET)
    ids = generate_ids(engine, PROMPTS)
    engine.close()
    engine = make_engine(TARGET, DRAFT)
    recorder = Recorder(engine)
    spec_ids = generate_ids(engine, PROMPTS)
    rate = acceptance(engine)
    engine.close()
    assert spec_ids == ids, "greedy speculation must equal target-only at pp1"
    # Trained: most drafts are accepted, and some are not.
    assert 0.3 < rate < 1.0
    return Reference(ids, recorder.drafts_by_sequence(), rate)


def run_layout(ref: Reference, pp: int, tp: int) -> None:
    engine = make_engine(
        TARGET, DRAFT, pipeline_parallel_size=pp, tensor_parallel_size=tp
    )
    try:
        recorder = Recorder(engine)
        ids = generate_ids(engine, PROMPTS)
        rate = acceptance(engine)
        facts = engine.workers.call(embedding_facts)
        ranks = engine.workers.info.ranks
    finally:
        engine.close()
    print(
        f"\nMiniMax acceptance pp{pp} x tp{tp}: {rate:.4f} (pp1 {ref.acceptance:.4f})"
    )
    assert ids == ref.ids
    assert recorder.drafts_by_sequence() == ref.drafts
    assert rate == ref.acceptance
    for report, fact in zip(ranks, facts):
        first, last = report.pp_rank == 0, report.pp_rank == pp - 1
        ledger = report.memory_ledger
        assert ledger["embedding"] == (shard_bytes(tp) if first or last else 0)
        assert ledger["lm_head"] == (shard_bytes(tp) if last else 0)
        assert (ledger["draft"] > 0) == last
        assert fact["target_embedding_real"] == (first or last)
        if last:
            assert fact["draft_shares_target_table"]


def test_pp2_tp2_dspark_matches_pp1(reference):
    run_layout(reference, pp=2, tp=2)


@pytest.mark.slow
def test_pp2_tp4_dspark_matches_pp1(reference):
    run_layout(reference, pp=2, tp=4)
