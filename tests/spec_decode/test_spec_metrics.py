import random

import pytest

from atom.spec_decode.metrics import SpecDecodeStats


def test_fixed_width_identity_al_equals_one_plus_t_alpha():
    rng = random.Random(0)
    stats = SpecDecodeStats(7)
    for _ in range(500):
        stats.record(7, rng.randrange(8))
    assert stats.avg_tokens_per_forward == pytest.approx(1 + 7 * stats.acceptance_rate)


def test_variable_width_uses_per_position_rates():
    stats = SpecDecodeStats(4)
    for drafted, accepted in [(4, 4), (4, 1), (2, 2), (1, 0), (3, 2)]:
        stats.record(drafted, accepted)
    rho = stats.per_position_acceptance
    assert rho == [4 / 5, 3 / 5, 1 / 5, 1 / 5]
    # Counts of the same: how often the k-th draft was accepted, adding up to all.
    assert stats.accepted_per_position == [4, 3, 1, 1]
    assert sum(stats.accepted_per_position) == stats.total_accepted_tokens
    assert all(a >= b for a, b in zip(rho, rho[1:]))
    assert stats.avg_tokens_per_forward == pytest.approx(1 + sum(rho))
    assert stats.acceptance_rate == pytest.approx(9 / 14)


def test_pr_3023_line_53_60_percent_at_4_75_tokens_per_forward():
    stats = SpecDecodeStats(7)
    for _ in range(1504):
        stats.record(7, 4)
    for _ in range(496):
        stats.record(7, 3)
    assert stats.format_line() == (
        "[MTP Stats         ] Average toks/fwd: 4.75, "
        "Accepted/Total Draft tokens: 7504/14000, Acceptance rate: 53.60%, "
        "Accepted tokens distribution: {0: '0.00%', 1: '0.00%', 2: '0.00%', "
        "3: '24.80%', 4: '75.20%', 5: '0.00%', 6: '0.00%', 7: '0.00%'}"
    )
    summary = stats.as_dict()
    assert summary["total_draft_tokens"] == 14000
    assert summary["total_accepted_tokens"] == 7504
    assert summary["acceptance_rate"] == pytest.approx(0.536)
    assert summary["avg_tokens_per_forward"] == pytest.approx(4.752)
    assert summary["distribution"][4] == pytest.approx(0.752)


def test_empty_stats_and_bad_records():
    stats = SpecDecodeStats(3)
    assert (stats.acceptance_rate, stats.avg_tokens_per_forward) == (0.0, 1.0)
    assert "Acceptance rate: 0.00%" in stats.format_line()
    with pytest.raises(ValueError, match="num_accepted"):
        stats.record(2, 3)
    with pytest.raises(ValueError, match="num_drafted"):
        stats.record(4, 0)
