"""Losslessness of the rejection sampler, checked statistically with fixed seeds.

Each statistical test runs N = 20000 seeded trials over V = 6 tokens and compares
the emitted-token counts with the target p by Pearson's chi-square. Threshold:
the 1 - 1e-4 quantile of chi-square with 5 degrees of freedom (25.74), so a
correct sampler fails with probability 1e-4 per check and, with fixed seeds, the
outcome never changes between runs. The same statistic against the draft q
shows that the test can tell the two apart.
"""

import pytest
import torch
from scipy.stats import chi2

from atom.model_ops.rejection_sampler import rejection_sample

N = 20000
THRESHOLD = chi2.ppf(1 - 1e-4, df=5)

P = torch.tensor(
    [
        [0.30, 0.05, 0.25, 0.10, 0.00, 0.30],
        [0.10, 0.20, 0.20, 0.20, 0.20, 0.10],
        [0.05, 0.05, 0.40, 0.20, 0.20, 0.10],
    ]
)
Q = torch.tensor(
    [
        [0.10, 0.30, 0.10, 0.20, 0.20, 0.10],
        [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
    ]
)


def chi_square(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() * len(samples)
    observed_where_zero = counts[expected == 0].sum().item()
    assert observed_where_zero == 0, "emitted a token the target gives 0"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def run_trials(drafts: torch.Tensor, draft_probs: torch.Tensor | None):
    generator = torch.Generator().manual_seed(1234)
    first, second = [], []
    for row in drafts:
        emitted, accepted = rejection_sample(P, row, draft_probs, False, generator)
        assert len(emitted) == accepted + 1
        assert emitted[:accepted] == row[:accepted].tolist()
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append(emitted[1])
    return first, second


def sampled_drafts() -> torch.Tensor:
    generator = torch.Generator().manual_seed(99)
    columns = [
        torch.multinomial(q, N, replacement=True, generator=generator) for q in Q
    ]
    return torch.stack(columns, dim=1)


def test_sampled_draft_emits_the_target_distribution():
    first, second = run_trials(sampled_drafts(), Q)
    assert chi_square(first, P[0]) < THRESHOLD
    # Position 2 is reached only after acceptance, which is independent of it.
    assert len(second) > N // 4
    assert chi_square(second, P[1]) < THRESHOLD
    # The test has power: the draft's own law is rejected by a mile.
    assert chi_square(first, Q[0] * 0.999 + 0.001 / 6) > 50 * THRESHOLD


def test_greedy_draft_at_positive_temperature_is_lossless():
    drafts = torch.tensor([[1, 0]]).repeat(N, 1)  # q = one-hot, p(1) = 0.05
    first, second = run_trials(drafts, None)
    assert chi_square(first, P[0]) < THRESHOLD
    assert chi_square(second, P[1]) < THRESHOLD


def test_every_draft_accepted_draws_the_bonus_from_the_last_row():
    target = torch.tensor(
        [[0.5, 0.5, 0.0, 0.0], [0.0, 0.25, 0.75, 0.0], [0.0, 0.0, 0.0, 1.0]]
    )
    # q = p: every draft is accepted whatever u is.
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        emitted, accepted = rejection_sample(
            target, [1, 2], target[:2].clone(), False, generator
        )
        assert (emitted, accepted) == ([1, 2, 3], 2)


def test_a_draft_the_target_forbids_is_always_rejected():
    target = torch.tensor([[0.0, 0.6, 0.4], [1.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        emitted, accepted = rejection_sample(target, [0], None, False, generator)
        assert accepted == 0 and emitted[0] in (1, 2)


def test_greedy_mode_accepts_exact_argmax_matches():
    logits = torch.tensor(
        [
            [0.0, 2.0, 2.0, 1.0],  # argmax 1 (lowest index on the tie)
            [3.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 5.0],
            [0.0, 4.0, 0.0, 0.0],
        ]
    )
    assert rejection_sample(logits, [1, 0, 3], greedy=True) == ([1, 0, 3, 1], 3)
    assert rejection_sample(logits, [1, 0, 2], greedy=True) == ([1, 0, 3], 2)
    assert rejection_sample(logits, [2, 0, 3], greedy=True) == ([1], 0)
    assert rejection_sample(logits[:1], [], greedy=True) == ([1], 0)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="expected 3"):
        rejection_sample(P[:2], [0, 1], Q, False)
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample(P, [0, 1], Q[:1], False)
    with pytest.raises(ValueError, match="draft token ids"):
        rejection_sample(P, [0, 6], Q, False)
    with pytest.raises(ValueError, match="zero probability"):
        rejection_sample(P, [0, 1], torch.tensor([[0.0, 1, 0, 0, 0, 0]] * 2), False)
