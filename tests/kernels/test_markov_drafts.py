"""atom/kernels/markov_drafts.py against markov_head.greedy_drafts (torch)."""

import pytest
import torch

from atom.kernels import triton_available
from atom.models.dspark_base import MarkovHead
from atom.spec_decode.markov_head import greedy_drafts
from tests.kernels.devices import FLOAT_CASES


@pytest.mark.kernels
@pytest.mark.parametrize("device, dtype", FLOAT_CASES)
@pytest.mark.parametrize(
    "num_seqs, width, vocab, rank",
    # One block of the vocabulary, several, and more blocks than one pick chunk.
    [(1, 7, 64, 4), (3, 4, 300, 16), (2, 2, 70000, 8)],
)
def test_greedy_drafts_equal_the_torch_chain(
    device, dtype, num_seqs, width, vocab, rank
):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.markov_drafts import markov_greedy_drafts

    gen = torch.Generator().manual_seed(vocab)
    head = MarkovHead(vocab, rank)
    with torch.no_grad():
        head.markov_w1.weight.copy_(torch.randn(vocab, rank, generator=gen))
        head.markov_w2.weight.copy_(torch.randn(vocab, rank, generator=gen))
    head = head.to(device, dtype)
    # Strided rows, as the block pass's logits view is; ties broken by the
    # lowest token: some rows repeat their maximum further on.
    base = torch.randn(num_seqs, width, vocab + 3, generator=gen)[..., :vocab] * 4
    base[..., vocab - 1] = base[..., 1]
    base = base.to(device)
    anchors = torch.randint(0, vocab, (num_seqs,), generator=gen).to(device)
    expected = greedy_drafts(base, anchors, head.bias)
    got = markov_greedy_drafts(
        base, anchors, head.markov_w1.weight, head.markov_w2.weight
    )
    assert got.dtype == torch.long and got.shape == (num_seqs, width)
    assert torch.equal(got.cpu(), expected.cpu())
