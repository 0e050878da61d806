"""Scheduler test helpers shared by the plain and hybrid scheduler tests."""

from atom.model_engine.batch import BatchOutput, ScheduledBatch
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams

EOS = 2


def make_scheduler(**overrides) -> Scheduler:
    args = dict(
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        eos_token_id=EOS,
    )
    args.update(overrides)
    return Scheduler(**args)


def seq_of(tokens, **params) -> Sequence:
    return Sequence(list(tokens), SamplingParams(**params))


def answer(batch: ScheduledBatch, emitted=None, accepted=None, drafts=None):
    """BatchOutput for `batch`: defaults to one token 50 per sampled sequence."""
    ids = batch.sample_seq_ids
    emitted = emitted or [[50] for _ in ids]
    accepted = accepted or [len(e) - 1 for e in emitted]
    drafts = drafts or [[] for _ in ids]
    return BatchOutput(batch.batch_id, ids, emitted, accepted, drafts)


def run_until_sampled(sched: Scheduler, drafts=None) -> ScheduledBatch:
    """Schedule (and retire output-less batches) until a batch samples; answer it."""
    while True:
        batch = sched.schedule()
        assert batch is not None
        if batch.produces_output:
            sched.postprocess(batch, answer(batch, drafts=drafts))
            return batch
        sched.postprocess(batch, None)
