"""The batched verifier: losslessness checked statistically with fixed seeds, the
greedy rule, mixed draft counts and mixed greedy / sampled rows.

Each statistical test verifies N = 20000 sequences in one batch (seeds 0..N-1)
over V = 6 tokens and compares the emitted-token counts with the target p by
Pearson's chi-square. Threshold: the 1 - 1e-4 quantile of chi-square with 5
degrees of freedom (25.74), so a correct verifier fails with probability 1e-4
per check and, with fixed seeds, the outcome never changes between runs. The same
statistic against the draft q shows that the test can tell the two apart.
"""

import pytest
import torch
from scipy.stats import chi2

from atom.model_ops.rejection_sampler import verify_drafts
from atom.model_ops.sampler import sample_tokens
from atom.model_ops.sampling_metadata import SamplingMetadata

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


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    assert counts[expected == 0].sum() == 0, "emitted a token the target gives 0"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def sampled(num: int, temperature: float = 1.0, **settings) -> SamplingMetadata:
    return SamplingMetadata.build(
        [temperature] * num, seeds=list(range(num)), positions=11, **settings
    )


def verify_against_p(drafts, num_drafts, draft_probs):
    """Verify N sequences whose target rows are P (logits log P at temperature 1)."""
    num, width = drafts.shape
    logits = P[: width + 1].log().expand(num, -1, -1)
    emitted, accepted = verify_drafts(
        logits, drafts, num_drafts, draft_probs, sampled(num)
    )
    assert bool((accepted <= num_drafts).all())
    for j in range(width):  # accepted tokens are the drafts themselves
        kept = accepted > j
        assert torch.equal(emitted[kept, j], drafts[kept, j])
    return emitted, accepted


def sampled_drafts() -> torch.Tensor:
    generator = torch.Generator().manual_seed(99)
    columns = [
        torch.multinomial(q, N, replacement=True, generator=generator) for q in Q
    ]
    return torch.stack(columns, dim=1)


def test_sampled_drafts_emit_the_target_distribution():
    drafts = sampled_drafts()
    emitted, accepted = verify_against_p(
        drafts, torch.full((N,), 2), Q.expand(N, -1, -1)
    )
    assert chi_square(emitted[:, 0], P[0]) < THRESHOLD
    # Position 2 is reached only after acceptance, which is independent of it.
    reached = accepted >= 1
    assert int(reached.sum()) > N // 4
    assert chi_square(emitted[reached, 1], P[1]) < THRESHOLD
    # The test has power: the draft's own law is rejected by a mile.
    assert chi_square(emitted[:, 0], Q[0] * 0.999 + 0.001 / 6) > 50 * THRESHOLD


def test_mixed_draft_counts_stay_lossless():
    """Sequences verifying 0, 1 or 2 drafts in one batch all emit p's law."""
    drafts = sampled_drafts()
    num_drafts = torch.arange(N) % 3
    emitted, accepted = verify_against_p(drafts, num_drafts, Q.expand(N, -1, -1))
    assert set(accepted[num_drafts == 0].tolist()) == {0}
    for count in range(3):
        rows = num_drafts == count
        assert chi_square(emitted[rows, 0], P[0]) < THRESHOLD
    deep = (num_drafts == 2) & (accepted >= 1)
    assert chi_square(emitted[deep, 1], P[1]) < THRESHOLD
    # All accepted: the bonus comes from the row after the last draft.
    full = accepted == num_drafts
    bonus = emitted[full, num_drafts[full]]
    assert chi_square(bonus[num_drafts[full] == 1], P[1]) < THRESHOLD


def test_greedy_drafts_at_positive_temperature_are_lossless():
    drafts = torch.tensor([[1, 0]]).repeat(N, 1)  # q = one-hot, p(1) = 0.05
    emitted, accepted = verify_against_p(drafts, torch.full((N,), 2), None)
    assert chi_square(emitted[:, 0], P[0]) < THRESHOLD
    reached = accepted >= 1
    assert chi_square(emitted[reached, 1], P[1]) < THRESHOLD


def test_every_draft_accepted_draws_the_bonus_from_the_last_row():
    target = torch.tensor(
        [[0.5, 0.5, 0.0, 0.0], [0.0, 0.25, 0.75, 0.0], [0.0, 0.0, 0.0, 1.0]]
    )
    num = 200
    # q = p: every draft is accepted whatever u is.
    emitted, accepted = verify_drafts(
        target.log().expand(num, -1, -1),
        torch.tensor([[1, 2]]).repeat(num, 1),
        torch.full((num,), 2),
        target[:2].expand(num, -1, -1),
        sampled(num),
    )
    assert accepted.tolist() == [2] * num
    assert emitted.tolist() == [[1, 2, 3]] * num


def test_a_draft_the_target_forbids_is_always_rejected():
    target = torch.tensor([[0.0, 0.6, 0.4], [1.0, 0.0, 0.0]])
    num = 200
    emitted, accepted = verify_drafts(
        target.log().expand(num, -1, -1),
        torch.zeros(num, 1, dtype=torch.long),
        torch.ones(num, dtype=torch.long),
        None,
        sampled(num),
    )
    assert accepted.tolist() == [0] * num
    assert set(emitted[:, 0].tolist()) <= {1, 2}


GREEDY_LOGITS = torch.tensor(
    [
        [0.0, 2.0, 2.0, 1.0],  # argmax 1 (lowest index on the tie)
        [3.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 5.0],
        [0.0, 4.0, 0.0, 0.0],
    ]
)


def test_greedy_rule_accepts_exact_argmax_matches_with_mixed_counts():
    drafts = torch.tensor([[1, 0, 3], [1, 0, 2], [2, 0, 3], [1, 0, 0], [9, 9, 9]])
    num_drafts = torch.tensor([3, 3, 3, 2, 0])
    emitted, accepted = verify_drafts(
        GREEDY_LOGITS.expand(5, -1, -1),
        drafts,
        num_drafts,
        None,
        SamplingMetadata.build([0.0] * 5),
    )
    assert accepted.tolist() == [3, 2, 0, 2, 0]
    rows = [e[: a + 1] for e, a in zip(emitted.tolist(), accepted.tolist())]
    # Row 3 stops at its 2 drafts: its bonus is the argmax of row 2, whatever
    # its padded third draft says.
    assert rows == [[1, 0, 3, 1], [1, 0, 3], [1], [1, 0, 3], [1]]


def test_greedy_and_sampled_sequences_mix_and_match_their_own_runs():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 3, 50, generator=gen) * 3
    drafts = torch.randint(0, 50, (4, 2), generator=gen)
    drafts[1] = logits[1, :2].argmax(-1)  # a greedy sequence that accepts both
    num_drafts = torch.tensor([2, 2, 1, 0])
    q = torch.softmax(torch.randn(4, 2, 50, generator=gen), -1)
    settings = dict(
        temperatures=[0.9, 0.0, 1.3, 0.7],
        top_ks=[0, 0, 10, 0],
        top_ps=[1.0, 1.0, 1.0, 0.8],
        seeds=[5, None, 6, 7],
        positions=[30, 8, 12, 100],
    )
    emitted, accepted = verify_drafts(
        logits, drafts, num_drafts, q, SamplingMetadata.build(**settings)
    )
    assert accepted[1] == 2 and emitted[1].tolist() == logits[1].argmax(-1).tolist()
    for row in range(4):
        one = {k: v[row : row + 1] for k, v in settings.items()}
        count = int(num_drafts[row])
        alone, alone_accepted = verify_drafts(
            logits[row : row + 1, : count + 1],
            drafts[row : row + 1, :count],
            num_drafts[row : row + 1],
            q[row : row + 1, :count],
            SamplingMetadata.build(**one),
        )
        a = int(accepted[row])
        assert int(alone_accepted[0]) == a
        assert alone[0, : a + 1].tolist() == emitted[row, : a + 1].tolist()


def test_a_sequence_without_drafts_gets_the_plainly_sampled_token():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(64, 1, 40, generator=gen)
    sampling = SamplingMetadata.build(
        [0.8] * 64, top_ps=0.9, seeds=list(range(64)), positions=21
    )
    emitted, accepted = verify_drafts(
        logits,
        torch.zeros(64, 0, dtype=torch.long),
        torch.zeros(64, dtype=torch.long),
        None,
        sampling,
    )
    assert accepted.tolist() == [0] * 64
    assert torch.equal(emitted[:, 0], sample_tokens(logits[:, 0], sampling))


def test_bad_shapes_are_refused():
    drafts, counts = torch.tensor([[0, 1]]), torch.tensor([2])
    logits = P.log().unsqueeze(0)
    with pytest.raises(ValueError, match="target_logits must be"):
        verify_drafts(logits[:, :2], drafts, counts, None, sampled(1))
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_drafts(logits, drafts, counts, Q[:1].unsqueeze(0), sampled(1))
    with pytest.raises(ValueError, match="sampling metadata has 2 rows"):
        verify_drafts(logits, drafts, counts, None, sampled(2))
