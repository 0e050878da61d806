"""When the scheduler may start new prompts while others decode.

The scheduler runs prefill and decode in separate batches (scheduler.py), so a
prompt admitted while sequences decode costs all of them one step: an eager
prefill forward, where a decode step replays a CUDA graph. When requests arrive
one by one (a server under load, and more so under speculation, where requests
finish after uneven numbers of steps), admitting each at once pays that stall per
request. Holding new prompts back for a moment lets several share one prefill.

`scheduler_delay_factor` (vLLM's name and meaning) sets the moment: the oldest
waiting request is admitted once it has waited `factor x` the last prefill step's
latency, that is the time from scheduling a prefill batch that samples to its
output. 0 (the default) admits at once. Nothing is held back when no sequence is
running or when the step is a prefill batch anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class PrefillPacer:
    def __init__(
        self, delay_factor: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.delay_factor = delay_factor
        # The clock Sequence.arrival_time is read from.
        self.clock = clock
        self._started: dict[int, float] = {}
        # Seconds the last sampled prefill batch took, schedule to output.
        self.last_prefill_s = 0.0

    def started(self, batch_id: int) -> None:
        """A prefill batch was scheduled."""
        if self.delay_factor:
            self._started[batch_id] = self.clock()

    def finished(self, batch_id: int, sampled: bool) -> None:
        """A batch's output came back; a prefill batch that sampled was timed
        (one that did not was only launched, so its time says nothing)."""
        start = self._started.pop(batch_id, None)
        if start is not None and sampled:
            self.last_prefill_s = self.clock() - start

    def admits(self, oldest_arrival: float) -> bool:
        """May waiting requests start now, while others decode?"""
        if not self.delay_factor:
            return True
        waited = self.clock() - oldest_arrival
        return waited >= self.delay_factor * self.last_prefill_s
