"""Scheduler test helpers shared by the plain and hybrid scheduler tests."""

from dataclasses import fields

from atom.config import EngineLimits
from atom.model_engine.batch import BatchOutput, ScheduledBatch, TokenChoice
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams

EOS = 2


LIMIT_NAMES = {f.name for f in fields(EngineLimits)}


def make_scheduler(**overrides) -> Scheduler:
    """A scheduler on small limits; `overrides` name EngineLimits fields or
    Scheduler arguments."""
    limits = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    limits.update(block_size=4)
    args = dict(num_kv_blocks=64, eos_token_id=EOS)
    for name, value in overrides.items():
        (limits if name in LIMIT_NAMES else args)[name] = value
    return Scheduler(EngineLimits(**limits), **args)


def seq_of(tokens, **params) -> Sequence:
    return Sequence(list(tokens), SamplingParams(**params))


def answer(batch: ScheduledBatch, emitted=None, accepted=None, drafts=None):
    """BatchOutput for `batch`: defaults to one token 50 per sampled sequence."""
    ids = batch.sample_seq_ids
    emitted = emitted or [[50] for _ in ids]
    accepted = accepted or [len(e) - 1 for e in emitted]
    drafts = drafts or [[] for _ in ids]
    choices = [TokenChoice(*choice) for choice in zip(ids, emitted, accepted, drafts)]
    return BatchOutput(batch.batch_id, choices)


def run_until_sampled(sched: Scheduler, drafts=None) -> ScheduledBatch:
    """Schedule (and retire output-less batches) until a batch samples; answer it."""
    while True:
        batch = sched.schedule()
        assert batch is not None
        if batch.produces_output:
            sched.postprocess(batch, answer(batch, drafts=drafts))
            return batch
        sched.postprocess(batch, None)
