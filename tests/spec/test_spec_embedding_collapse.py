"""A draft bound to a wrong embedding keeps the output and loses its acceptance.

This is the failure speculation hides: the tokens are verified by the target, so a
draft embedding its block from an unloaded or foreign table still yields the right
text. Only the acceptance shows it, which is why the fitted drafts must accept well
above chance and why the loader refuses such drafts.
"""

from __future__ import annotations

import random

import torch

from atom import SamplingParams
from atom.model_ops.embed_head import VocabParallelEmbedding
from tests.spec.spec_helpers import (
    one_thread,  # noqa: F401  (autouse fixture)
    random_tokens,
    runner_of,
    spec_engine,
)

TARGET = "tiny-kimi-k31"
T = 7


def _run(wrong_embedding: bool) -> tuple[list[list[int]], dict]:
    engine = spec_engine(TARGET, T, max_num_seqs=16)
    if wrong_embedding:
        draft = runner_of(engine).drafter.model
        shared = draft.embed_tokens
        table = VocabParallelEmbedding(shared.num_embeddings, shared.embedding_dim)
        generator = torch.Generator().manual_seed(0)
        table.weight.copy_(torch.randn(table.weight.shape, generator=generator))
        draft._bind_shared("embed_tokens", table)
    rng = random.Random(17)
    prompts = [random_tokens(rng, 5 + 3 * i) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    stats = engine.get_mtp_statistics()
    engine.close()
    return [out["token_ids"] for out in outputs], stats


def test_wrong_embedding_keeps_tokens_and_collapses_acceptance():
    tokens, stats = _run(wrong_embedding=False)
    wrong_tokens, wrong_stats = _run(wrong_embedding=True)
    assert wrong_tokens == tokens
    print(f"right table: {stats}\nwrong table: {wrong_stats}")
    assert stats["total_accepted_tokens"] >= 12  # measured 24 of 2100
    assert wrong_stats["total_accepted_tokens"] * 4 <= stats["total_accepted_tokens"]
