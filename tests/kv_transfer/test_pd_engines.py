"""P/D between two real engines in this process, over Mooncake's `tcp` loopback.

A DSpark producer (pp1 x tp1, context-only) prefills held-out corpus prompts in
32-token chunks and holds their blocks; a DSpark consumer reads the KV, the
committed KDA slots and the draft's context rows, then decodes. Its greedy tokens
must equal the aggregated engine's (same speculative config) and the target-only
engine's; the first token comes from the producer and is emitted once; every
block is back in both free lists at the end. Failures fall back to a local
prefill with the same tokens. The side channel to the producer is the producer
engine itself (`DirectPeer`); tests/e2e/test_pd_serving.py runs it over HTTP.
"""

from __future__ import annotations

import logging
import random
import time

import pytest

from atom.distributed.rank_process import free_port
from atom.kv_transfer.peer import HttpPeer
from atom.kv_transfer.regions import EngineLayout
from atom.model_engine.llm_engine import LLMEngine
from atom.sampling_params import SamplingParams
from tests.e2e.engine_helpers import random_tokens
from tests.e2e.pp_probe import (
    PAIRS,
    corpus_prompts,
    embedding_facts,
    generate_ids,
    make_engine,
)

# Mooncake is in the `pd` extra, which CI installs; a contributor may lack it.
pytest.importorskip("mooncake.engine")

TARGET, DRAFT = PAIRS["k3"]
PROMPTS = corpus_prompts()
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PREFILL_ONLY = SamplingParams(temperature=0.0, max_tokens=1)
REMOTE_DECODE = {"do_remote_decode": True}
LEASE_S = 60.0


class DirectPeer:
    """The side channel (layout, release) straight into a producer engine."""

    def __init__(self, producer: LLMEngine) -> None:
        self.producer = producer

    def layout(self, url: str) -> EngineLayout:
        return EngineLayout.from_dict(self.producer.kv_transfer_info()["layout"])

    def release(self, url: str, transfer_id: int) -> None:
        self.producer.release_kv_transfer(transfer_id)


class RoutingPeer(DirectPeer):
    """DirectPeer for the URL "producer", real HTTP for any other."""

    def __init__(self, producer: LLMEngine) -> None:
        super().__init__(producer)
        self.http = HttpPeer(timeout_s=5.0)

    def layout(self, url: str) -> EngineLayout:
        return super().layout(url) if url == "producer" else self.http.layout(url)

    def release(self, url: str, transfer_id: int) -> None:
        if url == "producer":
            super().release(url, transfer_id)
        else:
            self.http.release(url, transfer_id)


def pd_engine(role: str, draft: str | None = DRAFT, **settings) -> LLMEngine:
    config = {"kv_role": role, "kv_connector": "mooncake", "protocol": "tcp"}
    config.update(kv_lease_timeout_s=LEASE_S, **settings)
    return make_engine(TARGET, draft, kv_transfer_config=config)


@pytest.fixture(scope="module")
def engines():
    producer, consumer = pd_engine("kv_producer"), pd_engine("kv_consumer")
    consumer.kv_connector.peer = DirectPeer(producer)
    aggregated = make_engine(TARGET, DRAFT)
    expected = generate_ids(aggregated, PROMPTS, GREEDY)
    aggregated_acceptance = aggregated.get_spec_decode_stats()
    aggregated.close()
    yield producer, consumer, expected, aggregated_acceptance
    for engine in (producer, consumer):
        engine.close()


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams, dict]]):
    """Step until done; per request: (every output in order, the last one)."""
    ids = [
        engine.add_request(prompt, params, kv_transfer_params=kv)
        for prompt, params, kv in requests
    ]
    seen = {request_id: [] for request_id in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    if engine.config.kv_role == "kv_consumer":
        engine.kv_connector.drain_releases()  # they go out in the background
    return [seen[request_id] for request_id in ids]


def prefill(producer: LLMEngine, prompts: list[list[int]] = PROMPTS) -> list[dict]:
    runs = run(producer, [(p, PREFILL_ONLY, REMOTE_DECODE) for p in prompts])
    return [outputs[-1].kv_transfer_params for outputs in runs]


def free_blocks(engine: LLMEngine) -> int:
    return engine.get_stats()["kv_cache_blocks_free"]


def test_pd_equals_aggregated_and_frees_every_block(engines):
    producer, consumer, expected, aggregated_acceptance = engines
    start = free_blocks(producer), free_blocks(consumer)
    target_only = make_engine(TARGET)
    assert generate_ids(target_only, PROMPTS, GREEDY) == expected
    target_only.close()

    params = prefill(producer)
    assert len(producer.scheduler.held) == len(PROMPTS)
    assert free_blocks(producer) < start[0]  # held for the consumer
    remote = [{**p, "remote_url": "producer"} for p in params]
    runs = run(consumer, [(p, GREEDY, kv) for p, kv in zip(PROMPTS, remote)])

    for outputs, kv, want in zip(runs, params, expected):
        streamed = [t for output in outputs for t in output.new_token_ids]
        assert streamed == outputs[-1].output_token_ids == want
        # The producer's token opens the decode side's output, once.
        assert outputs[0].new_token_ids == [kv["first_token_id"]] == want[:1]
        assert kv["draft_token_ids"] == [] and kv["context_kv_only"]
    # Bootstrapped from the received context rows, decoding drafts, accepts and
    # distributes exactly as the aggregated engine.
    assert consumer.get_spec_decode_stats() == aggregated_acceptance
    assert producer.scheduler.held == {} and consumer.scheduler.parked == []
    assert (free_blocks(producer), free_blocks(consumer)) == start


def test_failed_transfers_fall_back_to_local_prefill(engines, caplog):
    producer, consumer, expected, _ = engines
    start = free_blocks(producer), free_blocks(consumer)
    bad_blocks, unreachable = prefill(producer, PROMPTS[:2])
    dead_url = f"http://127.0.0.1:{free_port()}"
    broken = [
        # the producer's blocks are not where it says: the read itself fails
        {**bad_blocks, "remote_url": "producer", "remote_block_ids": [10**9] * 8},
        # nobody listens at the producer's address: the handshake fails
        {**unreachable, "remote_url": dead_url},
    ]
    direct, consumer.kv_connector.peer = consumer.kv_connector.peer, RoutingPeer(
        producer
    )
    try:
        with caplog.at_level(logging.WARNING):
            runs = run(consumer, [(p, GREEDY, kv) for p, kv in zip(PROMPTS, broken)])
    finally:
        consumer.kv_connector.peer = direct
    assert [outputs[-1].output_token_ids for outputs in runs] == expected[:2]
    falls = [
        r.message for r in caplog.records if "falling back to prefill" in r.message
    ]
    assert len(falls) == 2
    assert any("outside" in m for m in falls) and any(dead_url in m for m in falls)
    # The failed read released its transfer; the unreachable one's lease ends it.
    assert list(producer.scheduler.held) == [unreachable["transfer_id"]]
    assert producer.scheduler.expire_leases(time.monotonic() + LEASE_S) == [
        unreachable["transfer_id"]
    ]
    assert (free_blocks(producer), free_blocks(consumer)) == start


def test_params_that_would_break_the_engine_are_refused(engines):
    _, consumer, _, _ = engines
    remote = {"do_remote_prefill": True, "remote_url": "producer"}
    for bad, named in (
        ({**remote, "first_token_id": 10**9}, "outside the vocabulary"),
        ({**remote, "first_token_id": "a"}, "first_token_id must be a token id"),
        ({**remote, "first_token_id": 3, "remote_url": 7}, "remote_url must be"),
    ):
        with pytest.raises(ValueError, match=named):
            consumer.add_request(PROMPTS[0], GREEDY, kv_transfer_params=bad)
    assert consumer.scheduler.is_finished()
    plain = make_engine(TARGET)
    with pytest.raises(ValueError, match="runs without --kv-transfer-config"):
        plain.add_request(PROMPTS[0], GREEDY, kv_transfer_params=remote)
    plain.close()


def test_a_request_aborted_while_parked_frees_both_sides(engines):
    producer, consumer, expected, _ = engines
    start = free_blocks(producer), free_blocks(consumer)
    first, second = prefill(producer, PROMPTS[:2])
    parked = consumer.add_request(
        PROMPTS[0], GREEDY, kv_transfer_params={**first, "remote_url": "producer"}
    )
    consumer.step()  # admitted and parked; its receive comes with the next step
    assert len(consumer.scheduler.parked) == 1
    consumer.abort_request(parked)
    # The next receive must not read into the aborted request's freed blocks.
    (outputs,) = run(
        consumer, [(PROMPTS[1], GREEDY, {**second, "remote_url": "producer"})]
    )
    assert outputs[-1].output_token_ids == expected[1]
    assert producer.scheduler.held == {} and consumer.scheduler.parked == []
    assert (free_blocks(producer), free_blocks(consumer)) == start


def test_a_consumer_without_the_draft_is_refused_by_name(engines, caplog):
    producer, _, expected, _ = engines
    plain = pd_engine("kv_consumer", draft=None)
    plain.kv_connector.peer = DirectPeer(producer)
    (kv,) = prefill(producer, PROMPTS[:1])
    kv = {**kv, "remote_url": "producer"}
    with caplog.at_level(logging.WARNING):
        (outputs,) = run(plain, [(PROMPTS[0], GREEDY, kv)])
    plain.close()
    assert outputs[-1].output_token_ids == expected[0]
    (refusal,) = [r.message for r in caplog.records if "falling back" in r.message]
    assert "regions only on the peer: draft.mla.0" in refusal
    assert producer.scheduler.held == {}


def test_draft_rows_withheld_keep_the_tokens_and_lower_acceptance(engines, caplog):
    """A producer without the draft sends no context rows: a DSpark consumer
    refuses it, unless allowed to leave its draft cold; then its greedy tokens
    stay, and only acceptance falls below the aggregated run's."""
    _, _, expected, aggregated_acceptance = engines
    plain_producer = pd_engine("kv_producer", draft=None)
    strict = pd_engine("kv_consumer")
    cold = pd_engine("kv_consumer", allow_cold_draft=True)
    try:
        for consumer in (strict, cold):
            consumer.kv_connector.peer = DirectPeer(plain_producer)
        (kv,) = prefill(plain_producer, PROMPTS[:1])
        with caplog.at_level(logging.WARNING):
            run(strict, [(PROMPTS[0], GREEDY, {**kv, "remote_url": "producer"})])
        assert "regions only here: draft.mla.0, draft.mla.1" in caplog.text
        params = prefill(plain_producer)
        remote = [{**p, "remote_url": "producer"} for p in params]
        runs = run(cold, [(p, GREEDY, kv) for p, kv in zip(PROMPTS, remote)])
        assert [outputs[-1].output_token_ids for outputs in runs] == expected
        falls = [r for r in caplog.records if "falling back" in r.message]
        assert len(falls) == 1  # the strict consumer's refusal only
        rate = cold.get_spec_decode_stats()["acceptance_rate"]
        assert rate < aggregated_acceptance["acceptance_rate"]
    finally:
        for engine in (plain_producer, strict, cold):
            engine.close()


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread_torch")
def test_minimax_from_a_pp4_producer():
    """The upstream case: MiniMax-M3 with its Qwen3 DSpark draft, prefilled by a
    producer split over four stages (four rank processes), decoded on one rank."""
    target, draft = "tiny-minimax-m3", "tiny-minimax-m3-dspark"
    prompts = [random_tokens(random.Random(7), n) for n in (26, 45)]
    expected = generate_ids(make_engine(target), prompts, GREEDY)
    config = {"kv_role": "kv_producer"}
    producer = make_engine(
        target, draft, pipeline_parallel_size=4, kv_transfer_config=config
    )
    consumer = make_engine(target, draft, kv_transfer_config={"kv_role": "kv_consumer"})
    consumer.kv_connector.peer = DirectPeer(producer)
    try:
        stages = producer.kv_transfer_info()["layout"]["ranks"]
        assert [rank["pp_rank"] for rank in stages] == [0, 1, 2, 3]
        # Context-only: the last stage builds no embedding, its draft binds none.
        last = producer.workers.call(embedding_facts)[3]
        assert not last["target_embedding_real"] and last["draft_embedding_is_none"]
        assert producer.workers.info.ranks[3].memory_ledger["embedding"] == 0
        assert "draft.attn.0" in {r["name"] for r in stages[3]["regions"]}
        params = prefill(producer, prompts)
        remote = [{**kv, "remote_url": "producer"} for kv in params]
        runs = run(consumer, [(p, GREEDY, kv) for p, kv in zip(prompts, remote)])
        assert [outputs[-1].output_token_ids for outputs in runs] == expected
        assert producer.scheduler.held == {}
    finally:
        producer.close()
        consumer.close()
