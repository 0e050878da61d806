"""Step plans: a fixed count, and the checks on a time budget's settings."""

import pytest

from tools.step_plan import CALIBRATION_STEPS, StepPlan


def test_without_a_budget_the_count_is_fixed():
    plan = StepPlan(steps=5, seconds=0, warmup_steps=1)
    for step in range(5):
        plan.after_step(step)
    assert plan.total == 5


def test_a_budget_keeps_at_least_the_calibration_steps_and_at_most_steps():
    plan = StepPlan(steps=CALIBRATION_STEPS + 3, seconds=1e9, warmup_steps=10)
    for step in range(CALIBRATION_STEPS):
        plan.after_step(step)
    assert plan.total == CALIBRATION_STEPS + 3
    tight = StepPlan(steps=1000, seconds=1e-12, warmup_steps=10)
    for step in range(CALIBRATION_STEPS):
        tight.after_step(step)
    assert tight.total == CALIBRATION_STEPS


@pytest.mark.parametrize(
    "steps, seconds, warmup, message",
    [(0, 0, 1, "steps"), (5, -1, 10, "seconds"), (5, 10, 2, "warmup_steps")],
)
def test_bad_settings_are_named(steps, seconds, warmup, message):
    with pytest.raises(ValueError, match=message):
        StepPlan(steps, seconds, warmup)
