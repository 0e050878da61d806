"""How many steps a training stage runs (a fixed count, or what fits a time budget),
and the loop that runs them.

With a budget the count is fixed once the first `CALIBRATION_STEPS` steps are timed
(the first two untimed: allocator and kernel warm-up). Those steps must lie inside
the learning-rate warm-up, which does not depend on the total, so the run is the
one a fixed `steps` equal to the chosen count would give: reports record it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

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


def run_steps(
    plan: StepPlan,
    optimizer: torch.optim.Optimizer,
    learning_rate: Callable[[int, int], float],
    step_loss: Callable[[int], torch.Tensor],
    grad_clip: float,
    after_update: Callable[[], None] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Run the plan's steps: the rate `learning_rate(step, total)`, the loss of
    `step_loss(step)`, a clipped optimizer update, then `after_update()`. Returns
    every loss; `progress(step, total, loss)` hears of each."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    losses = []
    step = 0
    while step < plan.total:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, plan.total)
        loss = step_loss(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        if after_update is not None:
            after_update()
        losses.append(loss.item())
        plan.after_step(step)
        if progress is not None:
            progress(step, plan.total, losses[-1])
        step += 1
    return losses
