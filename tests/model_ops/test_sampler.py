import math

import pytest
import torch

from atom.model_ops.sampler import (
    draw_tokens,
    exponential_race,
    probs_for,
    sample_tokens,
)
from atom.model_ops.sampling_metadata import SamplingMetadata


def log_probs(*values: float) -> torch.Tensor:
    return torch.tensor([[math.log(v) for v in values]])


def test_greedy_takes_the_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    tokens = sample_tokens(logits, SamplingMetadata.build([0.0, 0.0]))
    assert tokens.tolist() == [1, 0]
    one_hot = probs_for(logits, 0.0)
    assert one_hot.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[0.5, 1.5, -1.0]])
    expected = torch.softmax(logits / 0.5, dim=-1)
    torch.testing.assert_close(probs_for(logits, 0.5), expected)


def test_top_k_keeps_the_k_largest_renormalised():
    probs = probs_for(log_probs(0.1, 0.4, 0.2, 0.3), 1.0, top_k=2)
    torch.testing.assert_close(probs, torch.tensor([[0, 0.4 / 0.7, 0, 0.3 / 0.7]]))


def test_top_k_keeps_ties_at_the_kth_value():
    probs = probs_for(torch.tensor([[2.0, 1.0, 1.0, 0.0]]), 1.0, top_k=2)
    assert (probs[0] > 0).tolist() == [True, True, True, False]


def test_top_p_keeps_the_smallest_head_reaching_p():
    logits = log_probs(0.1, 0.4, 0.2, 0.3)
    torch.testing.assert_close(
        probs_for(logits, 1.0, top_p=0.6), torch.tensor([[0, 0.4 / 0.7, 0, 0.3 / 0.7]])
    )
    torch.testing.assert_close(
        probs_for(logits, 1.0, top_p=0.75),
        torch.tensor([[0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9]]),
    )
    # p = 1 keeps everything, even a tiny tail.
    tail = probs_for(log_probs(0.999999, 0.000001), 1.0, top_p=1.0)
    assert tail[0, 1] > 0


def test_top_p_applies_to_the_top_k_renormalised_mass():
    probs = probs_for(log_probs(0.1, 0.4, 0.2, 0.3), 1.0, top_k=3, top_p=0.5)
    # After top-3: 0.44, 0.33, 0.22; 0.44 < 0.5 so the second token stays too.
    torch.testing.assert_close(probs, torch.tensor([[0, 0.4 / 0.7, 0, 0.3 / 0.7]]))


def test_per_row_settings():
    logits = torch.cat([log_probs(0.1, 0.4, 0.2, 0.3)] * 3)
    probs = probs_for(logits, [1.0, 1.0, 0.0], [2, -1, -1], [1.0, 0.75, 1.0])
    torch.testing.assert_close(probs[0], torch.tensor([0, 0.4 / 0.7, 0, 0.3 / 0.7]))
    torch.testing.assert_close(
        probs[1], torch.tensor([0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9])
    )
    assert probs[2].tolist() == [0, 1, 0, 0]
    with pytest.raises(ValueError, match="top_k: 2 values for 3 rows"):
        probs_for(logits, 1.0, [2, 2], 1.0)


def test_seeded_requests_are_reproducible_whatever_the_batch():
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))

    def draw(rows, seeds, position):
        sampling = SamplingMetadata.build(
            [1.0] * len(rows), seeds=seeds, positions=position
        )
        return sample_tokens(logits[rows], sampling).tolist()

    alone = [draw([1], [7], p)[0] for p in range(20)]
    batched = [draw([0, 1, 2], [3, 7, 9], p)[1] for p in range(20)]
    assert alone == batched
    assert [draw([1], [8], p)[0] for p in range(20)] != alone


def test_draws_stay_in_the_filtered_set_and_follow_it():
    num = 4000
    logits = log_probs(0.1, 0.4, 0.2, 0.3).repeat(num, 1)
    sampling = SamplingMetadata.build([1.0] * num, top_ks=2, seeds=list(range(num)))
    tokens = sample_tokens(logits, sampling)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[0] == counts[2] == 0
    assert abs(counts[1] / num - 4 / 7) < 0.03


def test_top_p_draws_follow_the_renormalised_head():
    num = 20000
    logits = log_probs(0.1, 0.4, 0.2, 0.3).repeat(num, 1)
    sampling = SamplingMetadata.build(
        [1.0] * num, top_ps=0.75, seeds=7, positions=list(range(num))
    )
    counts = torch.bincount(sample_tokens(logits, sampling), minlength=4).double()
    expected = torch.tensor([0, 0.4, 0.2, 0.3], dtype=torch.float64) / 0.9 * num
    assert counts[0] == 0
    # chi-square, 2 degrees of freedom: 0.9999 quantile 18.42 (fixed seeds).
    keep = expected > 0
    assert float(((counts - expected)[keep] ** 2 / expected[keep]).sum()) < 18.42


def test_exponential_race_needs_no_normalising_and_skips_zero_weights():
    num = 20000
    weights = torch.tensor([[0.0, 3.0, 1.0, 0.0]]).repeat(num, 1)
    seeds = torch.arange(num)
    tokens = draw_tokens(weights, seeds, torch.zeros(num, dtype=torch.long), 3)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[0] == counts[3] == 0
    assert abs(counts[1] / num - 0.75) < 0.015
    # Ties between equal keys go to the lowest index.
    unit = torch.full((1, 4), 0.5)
    assert exponential_race(torch.tensor([[0.0, 1.0, 1.0, 0.5]]), unit).tolist() == [1]


def test_greedy_and_sampled_rows_mix():
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 0.0]])
    sampling = SamplingMetadata.build([0.0, 1.0], seeds=[None, 1])
    tokens = sample_tokens(logits, sampling)
    assert tokens[0] == 1 and 0 <= tokens[1] < 3
    with pytest.raises(ValueError, match="logits must be"):
        sample_tokens(logits[:1], sampling)


def test_sampling_metadata_refuses_bad_settings():
    with pytest.raises(ValueError, match="without a seed"):
        SamplingMetadata.build([0.0, 0.5], seeds=[None, None])
    with pytest.raises(ValueError, match="temperatures"):
        SamplingMetadata.build([-0.5], seeds=[1])
    with pytest.raises(ValueError, match="top_ps"):
        SamplingMetadata.build([0.5], top_ps=0.0, seeds=[1])
    with pytest.raises(ValueError, match="seeds: 1 values for 2"):
        SamplingMetadata.build([0.5, 0.5], seeds=[1])
    flags = SamplingMetadata.build([0.0, 1.0], top_ks=[5, -1], seeds=[None, 1])
    # Only sampled rows count: a greedy row's top-k never costs a sort.
    assert not flags.uses_top_k and not flags.uses_top_p and not flags.all_greedy
