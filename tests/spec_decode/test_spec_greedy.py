"""Greedy speculation is lossless: the tokens are the target-only engine's, exactly.

Both tiny targets with their distilled drafts; batch 1 and a mixed batch of 12
prompts (1 to 53 tokens, held-out text and random tokens, shared prefixes, chunked
prefill), prefix caching on and off, T in {1, 3, 7}, max_tokens that end inside a
verify block, and a prompt whose greedy continuation reaches EOS (also inside a
fully accepted block, with a forced drafter); for that the targets' LM head is edited
(`eos_target`). The drafts' acceptance must stay high: a draft that silently lost
its context rows, taps or embedding would keep the output right and fail only here.
"""

from __future__ import annotations

import random

import pytest

from atom import SamplingParams
from tests.spec_decode.spec_helpers import (
    BLOCK_SIZE,
    EOS,
    PAIRS,
    corpus_tokens,
    eos_target,
    force_drafts,
    random_tokens,
    spec_engine,
    target_engine,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

EOS_INDEX = 10
EOS_FIRST = 6  # eos comes as token 6 or later of this prompt's continuation
SHARED = [0, 3, 5, 9]  # prompts starting with the shared prefix
# Mostly not 1 + k(T + 1): the last verify of a request is clipped to num_drafts < T.
MAX_TOKENS = [9, 12, 17, 5, 13, 20, 8, 14, 11, 10, 24, 6]
# Floors at T = 7 on this batch (a third of it random tokens), far below what the
# distilled drafts reach (see docs/tiny_models.md) and far above a broken draft's.
MIN_ACCEPTANCE_RATE = 0.2
MIN_FIRST_DRAFT_RATE = 0.4


def mixed_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(11)
    text = corpus_tokens(8, words=40)
    shared = text[0][: 2 * BLOCK_SIZE]
    prompts = [
        shared + text[1][:5],
        random_tokens(rng, 1),
        text[2][:40],
        shared[:20] + random_tokens(rng, 3),
        text[3][:7],
        shared + text[4][:21],
        random_tokens(rng, BLOCK_SIZE),
        text[5][:3],
        random_tokens(rng, 26),
        shared[:33],
        text[6][:14],  # the EOS prompt
        text[7][:12],
    ]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    return prompts, params


@pytest.fixture(scope="module", params=list(PAIRS))
def reference(request, tmp_path_factory):
    """(target folder, draft, prompts, params, target-only outputs, eos position) of
    the mixed batch, on the target edited to emit eos on prompt EOS_INDEX."""
    prompts, params = mixed_batch()
    folder = tmp_path_factory.mktemp(request.param) / "eos"
    target, eos_at = eos_target(request.param, prompts[EOS_INDEX], EOS_FIRST, folder)
    engine = target_engine(target, max_num_seqs=16, max_num_batched_tokens=128)
    outputs = engine.generate(prompts, params)
    engine.close()
    eos_run = outputs[EOS_INDEX]
    assert eos_run["finish_reason"] == "stop" and eos_run["token_ids"][-1] == EOS
    assert len(eos_run["token_ids"]) == eos_at < MAX_TOKENS[EOS_INDEX]
    return target, PAIRS[request.param], prompts, params, outputs, eos_at


def _tokens(outputs: list[dict]) -> list[list[int]]:
    return [out["token_ids"] for out in outputs]


@pytest.mark.parametrize(
    "num_drafts, prefix_caching, chunk",
    [(7, True, 32), (3, False, 32), (1, True, 512)],
    ids=["T7-prefix-chunked", "T3-no-prefix-chunked", "T1-prefix"],
)
def test_mixed_batch_matches_target_only(reference, num_drafts, prefix_caching, chunk):
    target, draft, prompts, params, expected, _ = reference
    engine = spec_engine(
        target,
        num_drafts,
        draft,
        # One state checkpoint per sequence slot: 16 keep every prompt's, so the
        # second pass below resumes from them.
        max_num_seqs=16,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=prefix_caching,
    )
    first = engine.generate(prompts, params)
    assert _tokens(first) == _tokens(expected)
    assert [o["finish_reason"] for o in first] == [o["finish_reason"] for o in expected]
    if prefix_caching:
        # Again, for the prompts that share a prefix: now they all hit the cache.
        hits_before = engine.get_stats()["prefix_cache_hit_tokens"]
        again = engine.generate(
            [prompts[i] for i in SHARED], [params[i] for i in SHARED]
        )
        assert engine.get_stats()["prefix_cache_hit_tokens"] > hits_before
        assert _tokens(again) == [expected[i]["token_ids"] for i in SHARED]
    stats = engine.get_spec_decode_stats()
    engine.close()
    print(f"{target} T={num_drafts}: {stats}")
    assert stats["num_verify_steps"] > 0
    if num_drafts == 7:
        assert stats["acceptance_rate"] >= MIN_ACCEPTANCE_RATE
        assert stats["per_position_acceptance"][0] >= MIN_FIRST_DRAFT_RATE


@pytest.mark.parametrize("num_drafts", [1, 3, 7])
def test_batch_of_one_matches_target_only(reference, num_drafts):
    target, draft, prompts, params, expected, _ = reference
    engine = spec_engine(
        target, num_drafts, draft, max_num_seqs=1, max_num_batched_tokens=32
    )
    for index in (EOS_INDEX, 2):  # EOS mid-run; a 40-token prompt in 2 chunks
        (out,) = engine.generate([prompts[index]], [params[index]])
        assert out["token_ids"] == expected[index]["token_ids"]
        assert out["finish_reason"] == expected[index]["finish_reason"]
    engine.close()


def test_eos_inside_an_accepted_block(reference):
    """With every draft right, each verify emits T + 1 tokens; EOS lands inside a
    block, the tokens after it are dropped and the block still counts T accepted."""
    target, draft, prompts, _, _, eos_at = reference
    prompt, width = prompts[EOS_INDEX], 7
    reference = target_engine(target, max_num_seqs=1)
    long_run = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (full,) = reference.generate([prompt], long_run)
    reference.close()
    stop_at = full["token_ids"].index(EOS) + 1
    # Token 1 comes from the prefill, then blocks of T + 1: EOS is not a block end.
    assert stop_at == eos_at and (stop_at - 1) % (width + 1) != 0
    engine = spec_engine(target, width, draft, max_num_seqs=1)
    force_drafts(engine, [prompt], [prompt + full["token_ids"]], width)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    stats = engine.get_spec_decode_stats()
    engine.close()
    assert out["token_ids"] == full["token_ids"][:stop_at]
    assert out["finish_reason"] == "stop"
    assert stats["num_verify_steps"] == -(-(stop_at - 1) // (width + 1))
    assert stats["total_accepted_tokens"] == width * stats["num_verify_steps"]
