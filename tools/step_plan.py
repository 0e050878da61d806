"""How many steps a training stage runs: a fixed count, or what fits a time budget.

With a budget the count is fixed once the first `CALIBRATION_STEPS` steps are timed
(the first two untimed: allocator and kernel warm-up). Those steps must lie inside
the learning-rate warm-up, which does not depend on the total, so the run is the
one a fixed `steps` equal to the chosen count would give: reports record it.
"""

from __future__ import annotations

import time

CALIBRATION_STEPS = 8
_UNTIMED = 2


class StepPlan:
    def __init__(self, steps: int, seconds: float, warmup_steps: int) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if seconds and warmup_steps < CALIBRATION_STEPS:
            raise ValueError(
                f"a time budget needs warmup_steps >= {CALIBRATION_STEPS} (the "
                f"calibration steps), got {warmup_steps}"
            )
        self.total = steps
        self.seconds = seconds
        self._timer_start = 0.0

    def after_step(self, step: int) -> None:
        """Call after step `step` (0-based) finished."""
        if not self.seconds or step >= CALIBRATION_STEPS:
            return
        if step == _UNTIMED - 1:
            self._timer_start = time.monotonic()
        elif step == CALIBRATION_STEPS - 1:
            per_step = (time.monotonic() - self._timer_start) / (
                CALIBRATION_STEPS - _UNTIMED
            )
            fitting = int(self.seconds / max(per_step, 1e-9))
            self.total = min(self.total, max(CALIBRATION_STEPS, fitting))
