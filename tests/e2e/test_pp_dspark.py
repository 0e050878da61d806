"""DSpark under pipeline parallelism, end to end on CPU with real rank processes.

Each layout starts one engine (ranks over gloo) and runs a greedy batch of held-out
corpus prompts (9 to 70 tokens). Its tokens must equal pp1 x tp1 without
speculation; the drafts every sequence received must equal the pp1 x tp1 DSpark
run's (the relay only copies, so a wrong or missing tap changes the context rows and
with them the drafts); acceptance must stay within 2 points of pp1. The drafts are
the shipped ones, distilled from the trained targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from atom.models.tiny.configs import k3_text_config
from atom.models.utils import get_pp_indices
from atom.sampling_params import SamplingParams
from tests.e2e.pp_probe import (
    PAIRS,
    Recorder,
    acceptance,
    corpus_prompts,
    draft_context_rows,
    embedding_facts,
    generate_ids,
    make_engine,
)

PROMPTS = corpus_prompts()
# The shipped drafts on these prompts at pp1 x tp1 (measured: see docs/tiny_models.md);
# a draft that lost its context rows or embedding falls far below.
MIN_ACCEPTANCE = 0.25
TEXT = k3_text_config()
# One vocab-parallel fp32 table shard is vocab / tp x hidden x 4 bytes.
VOCAB, HIDDEN = TEXT["vocab_size"], TEXT["hidden_size"]


def shard_bytes(tp: int) -> int:
    return VOCAB // tp * HIDDEN * 4


@dataclass
class Reference:
    ids: list[list[int]]  # pp1 x tp1 without speculation
    drafts: list[list[list[int]]]  # every draft each sequence got at pp1 x tp1
    acceptance: float  # pp1 x tp1 DSpark
    loaded: dict[str, int]  # parameters the pp1 loader accounted for


pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(scope="module")
def reference():
    cache: dict[str, Reference] = {}

    def get(key: str) -> Reference:
        if key not in cache:
            target, draft = PAIRS[key]
            engine = make_engine(target)
            ids = generate_ids(engine, PROMPTS)
            engine.close()
            engine = make_engine(target, draft)
            recorder = Recorder(engine)
            assert generate_ids(engine, PROMPTS) == ids
            loaded = engine.workers.info.ranks[0].loaded_parameters
            cache[key] = Reference(
                ids, recorder.drafts_by_sequence(), acceptance(engine), loaded
            )
            engine.close()
        return cache[key]

    return get


def check_stages(info, facts, pp: int, tp: int, partition, ref: Reference) -> None:
    """Placement, strict loading and the memory ledger of every rank."""
    layers = TEXT["num_hidden_layers"]
    ranks = info.ranks
    assert [(r.pp_rank, r.tp_rank) for r in ranks] == [
        (p, t) for p in range(pp) for t in range(tp)
    ]
    for report, fact in zip(ranks, facts):
        stage = report.pp_rank
        first, last = stage == 0, stage == pp - 1
        assert report.layers == get_pp_indices(layers, stage, pp, partition)
        ledger = report.memory_ledger
        # First stage: its own table. Last stage: exactly one more shard, for the
        # drafter. Middle: none.
        assert ledger["embedding"] == (shard_bytes(tp) if first or last else 0)
        assert ledger["lm_head"] == (shard_bytes(tp) if last else 0)
        assert (ledger["draft"] > 0) == last
        assert fact["pp_holds_embedding"] == (first or last)
        assert fact["target_embedding_real"] == (first or last)
        assert fact["has_drafter"] == last
        if last:
            assert fact["draft_shares_target_table"]
            # Every draft parameter loaded: nothing unaccounted on the last stage.
            assert report.loaded_parameters["draft"] == ref.loaded["draft"]
        else:
            assert "draft" not in report.loaded_parameters
    # Every target parameter of pp1 is loaded on exactly one stage, plus the last
    # stage's copy of the embedding.
    tp0 = [r for r in ranks if r.tp_rank == 0]
    total = sum(r.loaded_parameters["target"] for r in tp0)
    assert total == ref.loaded["target"] + 1


LAYOUTS = [
    pytest.param("k3", 2, 4, None, id="k3-pp2xtp4"),
    pytest.param("k31", 2, 4, None, id="k31-pp2xtp4"),
    pytest.param("k3", 2, 1, None, id="k3-pp2xtp1"),
    pytest.param("k31", 2, 1, None, id="k31-pp2xtp1"),
    # Stage 1 owns layers 2-3 and no tap of [-1, 1, 4, 6]: it passes -1 and 1 on.
    pytest.param("k3", 3, 1, [2, 2, 4], id="k3-pp3-tapless-middle"),
]


@pytest.mark.slow
@pytest.mark.parametrize("key, pp, tp, partition", LAYOUTS)
def test_pp_dspark_matches_pp1(reference, key, pp, tp, partition):
    ref = reference(key)
    engine = make_engine(
        *PAIRS[key],
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        pp_layer_partition=partition,
    )
    try:
        recorder = Recorder(engine)
        ids = generate_ids(engine, PROMPTS)
        rate = acceptance(engine)
        facts = engine.workers.call(embedding_facts)
    finally:
        engine.close()
    print(f"\nacceptance {key} pp{pp} x tp{tp}: {rate:.4f} (pp1: {ref.acceptance:.4f})")
    assert ids == ref.ids
    assert recorder.drafts_by_sequence() == ref.drafts
    assert ref.acceptance > MIN_ACCEPTANCE
    assert abs(rate - ref.acceptance) <= 0.02
    check_stages(engine.workers.info, facts, pp, tp, partition, ref)


@pytest.mark.slow
def test_pp2_without_speculation_matches_pp1_and_holds_no_extra_table(reference):
    ref = reference("k3")
    engine = make_engine(PAIRS["k3"][0], pipeline_parallel_size=2)
    try:
        ids = generate_ids(engine, PROMPTS)
        facts = engine.workers.call(embedding_facts)
    finally:
        engine.close()
    assert ids == ref.ids
    first, last = engine.workers.info.ranks
    assert first.memory_ledger["embedding"] == shard_bytes(1)
    assert last.memory_ledger["embedding"] == 0 and last.memory_ledger["draft"] == 0
    assert not facts[1]["pp_holds_embedding"] and not facts[1]["has_drafter"]


@pytest.mark.slow
def test_producer_writes_draft_context_for_every_chunk_without_proposing(reference):
    target, draft = PAIRS["k3"]
    prompt = PROMPTS[-1]  # 70 tokens: three prefill chunks of at most 32
    first_token = SamplingParams(temperature=0.0, max_tokens=1)
    normal = make_engine(target, draft)
    normal_recorder = Recorder(normal)
    generate_ids(normal, [prompt], first_token)
    slots = normal_recorder.slots(0, len(prompt))
    (normal_rows,) = normal.workers.call(draft_context_rows(slots))
    normal.close()

    producer = make_engine(
        target, draft, pipeline_parallel_size=2, kv_role="kv_producer"
    )
    try:
        recorder = Recorder(producer)
        ids = generate_ids(producer, [prompt], first_token)
        facts = producer.workers.call(embedding_facts)
        rows = producer.workers.call(draft_context_rows(recorder.slots(0, len(prompt))))
    finally:
        producer.close()
    assert ids == [reference("k3").ids[-1][:1]]
    assert len(recorder.works_of(0)) >= 3  # the prompt ran as several chunks
    assert all(c.draft_token_ids == [] for out in recorder.outputs for c in out.choices)
    last = facts[-1]
    assert not last["pp_holds_embedding"] and not last["target_embedding_real"]
    assert last["has_drafter"] and last["draft_embedding_is_none"]
    assert producer.workers.info.ranks[-1].memory_ledger["embedding"] == 0
    assert rows[0] is None  # the first stage has no drafter
    for producer_layer, normal_layer in zip(rows[-1], normal_rows, strict=True):
        # A context row for every prompt position, i.e. from every chunk.
        assert np.all(np.abs(producer_layer).sum(axis=-1) > 0)
        np.testing.assert_array_equal(producer_layer, normal_layer)
