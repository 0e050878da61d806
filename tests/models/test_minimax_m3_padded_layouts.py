"""tiny-minimax-m3 in the padded layouts of captured CUDA graphs, eagerly on CPU:
dummy sequences that pad a decode batch, and the dummy that fills a short prefill
to its captured token count, change nothing real (logits and the request-owned KV
and index rows), with block-sparse selection live (prompts of 5+ index blocks of
4, top-2 kept). `test_kimi_k3_model.py` holds Kimi-K3 to the same."""

import pytest

from atom.model_engine.cuda_graph import PrefillShape
from tests.models.kimi_helpers import (
    assert_padding_changes_nothing,
    build_target,
    padded_decode_runs,
    padded_prefill_runs,
    work,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

TOL = {"atol": 2e-4, "rtol": 1e-4}
PROMPT = [(37 * i + 11) % 1000 for i in range(32)]
OTHER = [(53 * i + 7) % 1000 for i in range(32)]


@pytest.fixture(scope="module")
def minimax():
    return build_target("tiny-minimax-m3")[0]


@pytest.mark.parametrize("length", [32, 21], ids=["fills-the-size", "padded"])
def test_graph_prefill_shape_equals_the_prompt_alone(minimax, length):
    shape = PrefillShape(32, padded=length < 32)
    works = [work(PROMPT[:length], slot=1, first_block=4)]
    unpadded, padded = padded_prefill_runs(minimax, works, shape)
    metadata = padded.metadata
    assert metadata.num_tokens == 32 and metadata.num_seqs == 1 + shape.padded
    assert_padding_changes_nothing(unpadded, padded, TOL)


@pytest.mark.parametrize("num_drafts", [0, 3])
def test_graph_padded_decode_batch_equals_the_batch_alone(minimax, num_drafts):
    prompts = [PROMPT[:20], OTHER[:22]]
    rows = [PROMPT[20 : 21 + num_drafts], OTHER[22 : 23 + num_drafts]]
    unpadded, padded = padded_decode_runs(minimax, prompts, rows, num_drafts)
    assert padded.metadata.num_seqs == 5
    assert_padding_changes_nothing(unpadded, padded, TOL)
