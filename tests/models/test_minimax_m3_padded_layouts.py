"""tiny-minimax-m3 in the padded layouts of captured CUDA graphs, eagerly on CPU:
dummy sequences that pad a decode batch, and the dummy that fills a short prefill
to its captured token count, change nothing real (logits and the request-owned KV
and index rows), with block-sparse selection live (prompts of 5+ index blocks of
4, top-2 kept). `test_kimi_k3_model.py` holds Kimi-K3 to the same."""

import pytest
import torch

from atom.model_engine.cuda_graph import PrefillShape
from atom.model_engine.model_inputs import SeqPadding
from tests.models.kimi_helpers import (
    bind_caches,
    build_target,
    logits_of,
    run_padded,
    work,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

TOL = {"atol": 2e-4, "rtol": 1e-4}
PROMPT = [(37 * i + 11) % 1000 for i in range(32)]
OTHER = [(53 * i + 7) % 1000 for i in range(32)]


@pytest.fixture(scope="module")
def minimax():
    return build_target("tiny-minimax-m3")[0]


def assert_padding_changes_nothing(results) -> None:
    (logits, caches, _), (padded_logits, padded_caches, _) = results
    torch.testing.assert_close(padded_logits, logits, **TOL)
    for rows, padded_rows in zip(caches, padded_caches):
        torch.testing.assert_close(padded_rows, rows, **TOL)


@pytest.mark.parametrize("length", [32, 21], ids=["fills-the-size", "padded"])
def test_graph_prefill_shape_equals_the_prompt_alone(minimax, length):
    shape = PrefillShape(32, padded=length < 32)
    works = [work(PROMPT[:length], slot=1, first_block=4)]
    results = []
    for padded in (False, True):
        cache = bind_caches(minimax, num_blocks=32, slots=2)
        padding = shape.padding(cache.scratch_kv_slot, cache.scratch_state_slot)
        results.append(run_padded(minimax, works, cache, padding if padded else None))
    metadata = results[1][2]
    assert metadata.num_tokens == 32 and metadata.num_seqs == 1 + shape.padded
    assert_padding_changes_nothing(results)


@pytest.mark.parametrize("num_drafts", [0, 3])
def test_graph_padded_decode_batch_equals_the_batch_alone(minimax, num_drafts):
    prompts = [PROMPT[:20], OTHER[:22]]
    rows = [PROMPT[20 : 21 + num_drafts], OTHER[22 : 23 + num_drafts]]
    decode = [
        work(rows[i], len(prompts[i]), slot=i, num_drafts=num_drafts,
             first_block=16 * i)
        for i in range(2)
    ]  # fmt: skip
    results = []
    for padded in (False, True):
        cache = bind_caches(minimax, num_blocks=32, slots=2, spec_rows=4)
        logits_of(
            minimax,
            [work(p, slot=i, first_block=16 * i) for i, p in enumerate(prompts)],
        )
        padding = SeqPadding(5, cache.scratch_kv_slot, cache.scratch_state_slot)
        results.append(run_padded(minimax, decode, cache, padding if padded else None))
    assert results[1][2].num_seqs == 5
    assert_padding_changes_nothing(results)
