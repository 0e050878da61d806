import math

import pytest
import torch

from atom.model_ops.sampler import Sampler, probs_for


def log_probs(*values: float) -> torch.Tensor:
    return torch.tensor([[math.log(v) for v in values]])


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    tokens = Sampler().sample(logits, [0.0, 0.0], [-1, -1], [1.0, 1.0], [None, None])
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
    logits = torch.randn(3, 32, generator=seeded(0))
    sampler = Sampler()

    def draw(rows, seeds):
        gens = [seeded(s) for s in seeds]
        return [
            sampler.sample(logits[rows], [1.0] * len(rows), -1, 1.0, gens).tolist()
            for _ in range(20)
        ]

    alone = [step[0] for step in draw([1], [7])]
    batched = [step[1] for step in draw([0, 1, 2], [3, 7, 9])]
    assert alone == batched
    other_seed = [step[0] for step in draw([1], [8])]
    assert other_seed != alone


def test_draws_stay_in_the_filtered_set_and_follow_it():
    logits = log_probs(0.1, 0.4, 0.2, 0.3).repeat(4000, 1)
    gens = [seeded(i) for i in range(4000)]
    tokens = Sampler().sample(logits, 1.0, 2, 1.0, gens)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[0] == counts[2] == 0
    assert abs(counts[1] / 4000 - 4 / 7) < 0.03


def test_greedy_and_sampled_rows_mix():
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 0.0]])
    tokens = Sampler().sample(logits, [0.0, 1.0], -1, 1.0, [None, seeded(1)])
    assert tokens[0] == 1 and 0 <= tokens[1] < 3
    with pytest.raises(ValueError, match="generators"):
        Sampler().sample(logits, 1.0, -1, 1.0, [None])
