"""Holding new prompts back while others decode (model_engine/prefill_pacer.py):
which batches the scheduler makes on a clock the test moves by hand."""

import pytest

from atom.config import Config
from atom.model_engine.prefill_pacer import PrefillPacer
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams
from tests.model_engine.scheduler_helpers import answer, make_scheduler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def arriving(clock: Clock, n: int = 4) -> Sequence:
    return Sequence(
        list(range(3, 3 + n)), SamplingParams(max_tokens=50), arrival_time=clock()
    )


def prefill_of(sched, clock: Clock, took_s: float):
    """Schedule one batch, let it take `took_s`, answer it; the batch."""
    batch = sched.schedule()
    clock.now += took_s
    sched.postprocess(batch, answer(batch))
    return batch


def test_with_factor_zero_a_new_prompt_interrupts_decoding_at_once():
    clock = Clock()
    sched = make_scheduler(pacer=PrefillPacer(0.0, clock))
    sched.add(arriving(clock))
    prefill_of(sched, clock, 0.020)
    sched.add(arriving(clock))
    batch = sched.schedule()
    assert batch.work[0].context_len == 0  # the newcomer's prefill


def test_a_paced_prompt_waits_for_its_delay_and_late_arrivals_share_its_prefill():
    clock = Clock()
    sched = make_scheduler(pacer=PrefillPacer(0.5, clock))
    first = arriving(clock)
    sched.add(first)
    # Nothing runs yet: the first prompt starts at once; its prefill takes 20 ms.
    assert prefill_of(sched, clock, 0.020).sample_seq_ids == [first.seq_id]
    assert sched.pacer.last_prefill_s == pytest.approx(0.020)
    second = arriving(clock)
    sched.add(second)
    # Held back (waited 0 < 0.5 x 20 ms): the running sequence decodes.
    decode = prefill_of(sched, clock, 0.004)
    assert decode.sample_seq_ids == [first.seq_id]
    third = arriving(clock)
    sched.add(third)
    assert prefill_of(sched, clock, 0.004).sample_seq_ids == [first.seq_id]
    # 8 ms waited: still under 10 ms. At 12 ms both waiting prompts go in one batch.
    assert prefill_of(sched, clock, 0.004).sample_seq_ids == [first.seq_id]
    both = sched.schedule()
    assert both.sample_seq_ids == [second.seq_id, third.seq_id]
    assert all(work.context_len == 0 for work in both.work)


def test_nothing_is_held_back_when_no_sequence_runs():
    clock = Clock()
    sched = make_scheduler(pacer=PrefillPacer(10.0, clock))
    sched.pacer.last_prefill_s = 1.0
    seq = arriving(clock)
    sched.add(seq)
    assert sched.schedule().sample_seq_ids == [seq.seq_id]


def test_the_delay_factor_must_not_be_negative():
    with pytest.raises(ValueError, match="scheduler_delay_factor must be >= 0"):
        Config(model="tiny-kimi-k3", scheduler_delay_factor=-1.0)
