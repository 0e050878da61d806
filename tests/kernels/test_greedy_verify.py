"""atom/kernels/greedy_verify.py against verify_drafts' greedy rule (torch)."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.rejection_sampler import verify_drafts
from atom.model_ops.sampling_metadata import SamplingMetadata
from tests.kernels.devices import DEVICES


def verify_case(num_seqs, width, vocab, seed):
    """Logits rows, row_index, drafts and counts where many drafts match: each
    sequence's drafts copy its rows' argmax up to a random point."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, width + 1, (num_seqs,), generator=gen)
    counts[0] = width  # one sequence verifies the batch's full width
    rows = int(counts.sum()) + num_seqs
    # Rows in a shuffled order, as the scored rows of a mixed batch may be.
    order = torch.randperm(rows, generator=gen)
    logits = torch.randn(rows, vocab, generator=gen)
    row_index = torch.zeros(num_seqs, width + 1, dtype=torch.long)
    drafts = torch.zeros(num_seqs, width, dtype=torch.long)
    first = 0
    best = logits.argmax(-1)
    for s, count in enumerate(counts.tolist()):
        own = order[first : first + count + 1]
        first += count + 1
        # Padding repeats the sequence's last row (SamplingMetadata.build).
        row_index[s] = torch.cat([own, own[-1:].repeat(width - count)])
        agree = int(torch.randint(0, count + 1, (1,), generator=gen))
        drafts[s, :count] = torch.randint(0, vocab, (count,), generator=gen)
        drafts[s, :agree] = best[own[:agree]]
    return logits, row_index, drafts, counts


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_seqs,width", [(1, 7), (5, 3), (19, 7), (3, 1)])
def test_greedy_verify_equals_verify_drafts(device, num_seqs, width):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.greedy_verify import greedy_verify

    vocab = 50
    logits, row_index, drafts, counts = verify_case(num_seqs, width, vocab, width)
    positions = torch.arange(num_seqs) * 10 + 3
    sampling = SamplingMetadata.build([0.0] * num_seqs, positions=positions.tolist())
    emitted, accepted = verify_drafts(logits[row_index], drafts, counts, None, sampling)
    assert 0 < int(accepted.sum()) < int(counts.sum())  # the case mixes both

    # A wider fetch row, as the step's packed fetch leaves room for the drafts.
    out = torch.full((num_seqs, 2 * width + 5), -7, dtype=torch.long, device=device)
    anchor_positions = greedy_verify(
        logits.to(device).argmax(-1),
        row_index.to(device),
        drafts.to(device),
        counts.to(device),
        positions.to(device),
        out,
    )
    out = out.cpu()
    assert torch.equal(out[:, 0], accepted)
    assert torch.equal(out[:, 1 : width + 2], emitted)
    assert torch.equal(out[:, width + 2], emitted.gather(1, accepted[:, None])[:, 0])
    assert torch.equal(anchor_positions.cpu(), positions + accepted)
    assert (out[:, width + 3 :] == -7).all()  # the drafts' columns are left alone


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_refuses_a_fetch_too_narrow(device):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.greedy_verify import greedy_verify

    long = dict(dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"out must be \[2, >= 6\]"):
        greedy_verify(
            torch.zeros(8, **long),
            torch.zeros(2, 4, **long),
            torch.zeros(2, 3, **long),
            torch.zeros(2, **long),
            torch.zeros(2, **long),
            torch.zeros(2, 5, **long),
        )
