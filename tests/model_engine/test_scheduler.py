import pickle

import pytest

from atom.model_engine.batch import BatchOutput, TokenChoice
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import SequenceStatus
from tests.model_engine.scheduler_helpers import (
    EOS,
    answer,
    make_scheduler,
    run_until_sampled,
    seq_of,
)


# ---- chunked prefill and batching ----
def test_chunked_prefill_splits_on_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = seq_of(range(10, 30))
    sched.add(seq)
    chunks = []
    while (batch := sched.schedule()) is not None:
        assert batch.num_tokens <= 8
        (work,) = batch.work
        chunks.append((work.context_len, len(work.token_ids), work.sample))
        if not batch.produces_output:
            sched.postprocess(batch, None)
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert work.token_ids == list(range(26, 30))


def test_budget_is_shared_and_the_second_prompt_continues_next_batch():
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b = seq_of(range(10, 20)), seq_of(range(30, 40))
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [(w.seq_id, len(w.token_ids), w.sample) for w in first.work] == [
        (a.seq_id, 10, True),
        (b.seq_id, 6, False),
    ]
    second = sched.schedule()
    assert [(w.seq_id, w.context_len, len(w.token_ids)) for w in second.work] == [
        (b.seq_id, 6, 4)
    ]


def test_without_chunking_a_prompt_waits_for_a_batch_it_fits_in():
    sched = make_scheduler(
        max_num_batched_tokens=64, enable_chunked_prefill=False, num_kv_blocks=64
    )
    a, b = seq_of(range(40)), seq_of(range(100, 140))
    sched.add(a)
    sched.add(b)
    assert [w.seq_id for w in sched.schedule().work] == [a.seq_id]
    assert [len(w.token_ids) for w in sched.schedule().work] == [40]
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_continuous_batching_admits_new_requests_between_decode_steps():
    sched = make_scheduler()
    a = seq_of(range(10, 15), max_tokens=10)
    sched.add(a)
    run_until_sampled(sched)
    decode = sched.schedule()
    assert decode.work[0].token_ids == [50] and decode.work[0].context_len == 5
    sched.postprocess(decode, answer(decode, [[51]]))
    b = seq_of(range(20, 23))
    sched.add(b)
    # Prefill first: the newcomer runs alone, then both decode together.
    prefill = sched.schedule()
    assert [w.seq_id for w in prefill.work] == [b.seq_id]
    sched.postprocess(prefill, answer(prefill))
    both = sched.schedule()
    assert [(w.seq_id, w.context_len) for w in both.work] == [
        (a.seq_id, 6),
        (b.seq_id, 3),
    ]
    assert a.output_token_ids == [50, 51]


def test_max_num_seqs_bounds_running_sequences():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [seq_of([i + 10] * 3) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert len(batch.work) == 2 and len(sched.running) == 2
    assert sched.stats()["requests_waiting"] == 1


def test_eos_and_max_tokens_finish_and_free_resources():
    sched = make_scheduler()
    a, b = seq_of([5, 6, 7], max_tokens=1), seq_of([8, 9])
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    finished = sched.postprocess(batch, answer(batch, [[40], [EOS]]))
    assert [s.finish_reason for s in finished] == ["length", "stop"]
    assert sched.is_finished() and sched.block_manager.num_used_blocks == 0
    assert a.state_slot is None and b.state_slot is None
    ignore = seq_of([5, 6], ignore_eos=True, max_tokens=2)
    sched.add(ignore)
    batch = sched.schedule()
    # The last stage learns of finished sequences with the next batch.
    assert batch.finished_seq_ids == [a.seq_id, b.seq_id]
    sched.postprocess(batch, answer(batch))
    batch = sched.schedule()
    assert batch.finished_seq_ids == []
    assert sched.postprocess(batch, answer(batch, [[EOS]])) == [ignore]
    assert ignore.output_token_ids == [50, EOS]


# ---- preemption ----
def test_preemption_frees_the_sequence_and_recomputes_it_later():
    sched = make_scheduler(
        max_model_len=20, num_kv_blocks=5, enable_prefix_caching=False
    )
    a, b = seq_of(range(10, 17), max_tokens=3), seq_of(range(20, 27), max_tokens=3)
    sched.add(a)
    sched.add(b)
    assert b.queue_time is None  # not admitted yet
    run_until_sampled(sched)  # both prompts: 2 blocks each
    first_admitted = b.first_scheduled_time
    assert first_admitted is not None and b.queue_time >= 0
    step = sched.schedule()
    sched.postprocess(step, answer(step, [[60], [61]]))  # 9 tokens each
    step = sched.schedule()  # a takes the last block; b has none left
    assert [w.seq_id for w in step.work] == [a.seq_id]
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and sched.stats()["preemptions"] == 1
    sched.postprocess(step, answer(step, [[62]]))
    assert a.is_finished
    redo = sched.schedule()
    # Queue time ends at the first admission; a readmission does not restart it.
    assert b.first_scheduled_time == first_admitted
    (work,) = redo.work
    assert (work.seq_id, work.context_len, work.sample) == (b.seq_id, 0, True)
    assert work.token_ids == list(range(20, 27)) + [50, 61]


def test_output_in_flight_for_a_preempted_or_aborted_sequence_is_ignored():
    sched = make_scheduler(
        max_model_len=20, num_kv_blocks=5, enable_prefix_caching=False
    )
    b = seq_of(range(20, 28))
    sched.add(b)
    run_until_sampled(sched)
    b_decode = sched.schedule()  # b: 3 blocks; its output stays in flight
    a = seq_of(range(10, 18))
    sched.add(a)
    run_until_sampled(sched)  # a: 2 blocks, none left
    a_decode = sched.schedule()  # a needs a third block: b is preempted
    assert [w.seq_id for w in a_decode.work] == [a.seq_id]
    assert b.status is SequenceStatus.WAITING
    assert sched.postprocess(b_decode, answer(b_decode, [[70]])) == []
    assert b.output_token_ids == [50]
    sched.abort(a.request_id)
    assert sched.postprocess(a_decode, answer(a_decode, [[71]])) == []
    assert a.output_token_ids == [50] and a.finish_reason == "abort"
    assert a.seq_id in sched.schedule().finished_seq_ids


# ---- prefix caching ----
def test_prefix_hit_reuses_full_blocks_and_computes_the_rest():
    sched = make_scheduler()
    first = seq_of(range(10, 20))
    sched.add(first)
    run_until_sampled(sched)
    longer = seq_of(list(range(10, 20)) + [1, 1])
    sched.add(longer)
    (work,) = sched.schedule().work
    assert longer.num_cached_tokens == 8
    assert (work.context_len, work.token_ids) == (8, [18, 19, 1, 1])
    assert work.block_table[:2] == first.block_table[:2]
    assert work.state_fork_src is None


def test_full_prefix_hit_still_computes_one_block():
    sched = make_scheduler()
    first = seq_of(range(10, 18))
    sched.add(first)
    run_until_sampled(sched)
    same = seq_of(range(10, 18))
    sched.add(same)
    (work,) = sched.schedule().work
    assert (work.context_len, len(work.token_ids), work.sample) == (4, 4, True)


def test_blocks_written_in_a_batch_are_not_hits_within_it():
    sched = make_scheduler(max_num_batched_tokens=32)
    a, b = seq_of(range(10, 20)), seq_of(range(10, 20))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [w.context_len for w in batch.work] == [0, 0]
    c = seq_of(range(10, 20))
    sched.add(c)
    sched.postprocess(batch, answer(batch))
    assert sched.schedule().work[0].context_len == 8


# ---- speculative decoding ----
def spec_scheduler(**overrides) -> Scheduler:
    args = dict(num_speculative_tokens=3)
    args.update(overrides)
    return make_scheduler(**args)


def test_verify_rows_commits_and_drafts_flow_between_batches():
    sched = spec_scheduler()
    seq = seq_of(range(10, 16), max_tokens=20)
    sched.add(seq)
    run_until_sampled(sched, drafts=[[71, 72, 73]])
    verify = sched.schedule()
    (work,) = verify.work
    assert (work.token_ids, work.context_len, work.num_drafts) == (
        [50, 71, 72, 73],
        6,
        3,
    )
    assert verify.spec_commits == []
    # KV slots for the 4 verify rows plus 3 drafter block rows after them.
    assert len(work.block_table) * 4 >= 6 + 4 + 3
    sched.postprocess(verify, answer(verify, [[71, 90]], [1], [[81, 82, 83]]))
    assert seq.output_token_ids == [50, 71, 90]
    assert seq.num_computed_tokens == seq.num_tokens - 1
    nxt = sched.schedule()
    assert nxt.spec_commits == [(work.state_slot, 2)]
    assert (nxt.work[0].token_ids, nxt.work[0].context_len) == ([90, 81, 82, 83], 8)
    assert sched.spec_stats.total_draft_tokens == 3
    assert sched.spec_stats.total_accepted_tokens == 1


def test_a_verify_runs_ahead_counting_the_previous_drafts_accepted():
    """Async scheduling: the next verify is scheduled before the last one's
    acceptance is known; its context counts every draft accepted, its blocks cover
    that, and its state commit happens on the device (none is queued here)."""
    sched = spec_scheduler(async_scheduling=True)
    seq = seq_of(range(10, 16), max_tokens=20)
    sched.add(seq)
    prefill = sched.schedule()
    first = sched.schedule()  # runs ahead of the prefill's token
    (work,) = first.work
    assert work.input_pending and work.unconfirmed_drafts == 0
    assert (work.num_rows, work.num_drafts, work.context_len) == (4, 3, 6)
    sched.postprocess(prefill, answer(prefill, drafts=[[71, 72, 73]]))
    second = sched.schedule()  # runs ahead of the first verify's acceptance
    (ahead,) = second.work
    assert ahead.input_pending and ahead.unconfirmed_drafts == 3
    assert (ahead.num_rows, ahead.context_len) == (4, 7 + 3)
    # Rows up to the counted drafts, the next verify's and the drafter's block.
    assert len(ahead.block_table) * 4 >= 10 + 4 + 3
    # The first verify kept one draft; the host learns it now, and its state
    # commit is the runner's (the sequence already runs in `second`).
    sched.postprocess(first, answer(first, [[71, 90]], [1], [[81, 82, 83]]))
    assert seq.output_token_ids == [50, 71, 90]
    assert sched._pending_commits == {}
    # `second` kept every draft; nothing runs ahead of it, so its commit is queued.
    sched.postprocess(second, answer(second, [[81, 82, 83, 91]], [3], [[1, 2, 3]]))
    assert seq.output_token_ids == [50, 71, 90, 81, 82, 83, 91]
    assert seq.num_computed_tokens == seq.num_tokens - 1
    nxt = sched.schedule()
    assert nxt.spec_commits == [(work.state_slot, 4)]
    assert (nxt.work[0].token_ids, nxt.work[0].context_len) == ([91, 1, 2, 3], 12)
    assert not nxt.work[0].input_pending


@pytest.mark.parametrize("max_model_len, runs_ahead", [(15, True), (14, False)])
def test_a_verify_near_max_model_len_waits_for_the_host(max_model_len, runs_ahead):
    """Counting every unconfirmed draft accepted, the next verify must still fit
    all T drafts below max_model_len (as a synchronous one would), else it waits
    for the previous verify's tokens."""
    sched = spec_scheduler(async_scheduling=True, max_model_len=max_model_len)
    sched.add(seq_of(range(10, 16), max_tokens=8))
    prefill = sched.schedule()
    first = sched.schedule()
    sched.postprocess(prefill, answer(prefill, drafts=[[71, 72, 73]]))
    # 7 tokens and at most 3 + 1 more from `first`: the next verify's rows could
    # reach position 13, which `_num_drafts_to_verify` allows only below
    # max_model_len - 1.
    nxt = sched.schedule()
    if runs_ahead:
        assert nxt.work[0].input_pending
    else:
        assert nxt is None
        sched.postprocess(first, answer(first, [[71, 90]], [1], [[81, 82, 83]]))
        assert not sched.schedule().work[0].input_pending


def test_stop_inside_the_accepted_block_discards_later_tokens():
    sched = spec_scheduler()
    seq = seq_of(range(10, 16), max_tokens=20)
    sched.add(seq)
    run_until_sampled(sched, drafts=[[71, EOS, 73]])
    verify = sched.schedule()
    out = answer(verify, [[71, EOS, 73, 99]], [3], [[1, 1, 1]])
    assert sched.postprocess(verify, out) == [seq]
    assert seq.output_token_ids == [50, 71, EOS] and seq.finish_reason == "stop"
    # Acceptance is the drafter's: counted before the truncation.
    assert sched.spec_stats.total_accepted_tokens == 3
    sched.add(seq_of([5, 5]))
    nxt = sched.schedule()
    assert nxt.finished_seq_ids == [seq.seq_id] and nxt.spec_commits == []


def test_near_max_tokens_every_draft_is_verified_and_only_useful_ones_count():
    sched = spec_scheduler()
    seq = seq_of(range(10, 16), max_tokens=3)
    sched.add(seq)
    run_until_sampled(sched, drafts=[[71, 72, 73]])
    verify = sched.schedule()
    (work,) = verify.work
    # Only 2 more tokens may be emitted, yet all 3 drafts are verified: the batch
    # keeps T + 1 rows per sequence (the shape its CUDA graph was captured for).
    assert (work.token_ids, work.num_drafts) == ([50, 71, 72, 73], 3)
    finished = sched.postprocess(
        verify, answer(verify, [[71, 72, 73, 74]], [3], [[1, 1, 1]])
    )
    assert finished == [seq] and seq.finish_reason == "length"
    assert seq.output_token_ids == [50, 71, 72]
    # 1 draft could become output, and it was accepted: the other 2 are not counted.
    assert sched.spec_stats.total_draft_tokens == 1
    assert sched.spec_stats.total_accepted_tokens == 1


def test_with_one_token_left_the_verify_counts_no_draft():
    sched = spec_scheduler()
    seq = seq_of(range(10, 16), max_tokens=2)
    sched.add(seq)
    run_until_sampled(sched, drafts=[[71, 72, 73]])
    verify = sched.schedule()
    assert verify.work[0].num_drafts == 3
    finished = sched.postprocess(verify, answer(verify, [[71, 8]], [1], [[1, 1, 1]]))
    assert finished == [seq] and seq.output_token_ids == [50, 71]
    assert sched.spec_stats.num_steps == 0


def test_fewer_drafts_are_verified_near_max_model_len():
    sched = spec_scheduler(max_model_len=10)
    seq = seq_of(range(10, 17), max_tokens=20)
    sched.add(seq)
    run_until_sampled(sched, drafts=[[71, 72, 73]])
    verify = sched.schedule()
    assert verify.work[0].num_drafts == 1  # 8 tokens now, room for 2 more
    finished = sched.postprocess(verify, answer(verify, [[71, 72]], [1], [[1, 1, 1]]))
    assert finished == [seq] and seq.finish_reason == "length"
    assert seq.num_tokens == 10


def test_verify_result_is_checked_against_the_drafts():
    sched = spec_scheduler()
    sched.add(seq_of(range(10, 16)))
    run_until_sampled(sched, drafts=[[71, 72, 73]])
    verify = sched.schedule()
    with pytest.raises(RuntimeError, match="differ from the drafts"):
        sched.postprocess(verify, answer(verify, [[71, 99, 5]], [2], [[1, 1, 1]]))
    with pytest.raises(RuntimeError, match="emitted tokens"):
        sched.postprocess(verify, answer(verify, [[71, 72]], [2], [[1, 1, 1]]))


def test_a_plain_decode_answer_is_checked_too():
    """Rows without drafts take a quick check; a bad answer still fails it."""
    sched = make_scheduler()
    sched.add(seq_of([5, 6, 7]))
    batch = sched.schedule()
    (seq_id,) = batch.sample_seq_ids
    for choice, problem in [
        (TokenChoice(seq_id, [1, 2], 0, []), "2 emitted tokens"),
        (TokenChoice(seq_id, [1], 1, []), "1 accepted drafts of 0"),
    ]:
        with pytest.raises(RuntimeError, match=problem):
            sched.postprocess(batch, BatchOutput(batch.batch_id, [choice]))


# ---- protocol ----
def test_output_of_another_batch_raises():
    sched = make_scheduler()
    sched.add(seq_of([5, 6, 7]))
    batch = sched.schedule()
    (seq_id,) = batch.sample_seq_ids
    wrong = BatchOutput(batch.batch_id + 1, [TokenChoice(seq_id, [1], 0, [])])
    with pytest.raises(RuntimeError, match="out of step"):
        sched.postprocess(batch, wrong)
    stranger = BatchOutput(batch.batch_id, [TokenChoice(12345, [1], 0, [])])
    with pytest.raises(RuntimeError, match="expected"):
        sched.postprocess(batch, stranger)
    with pytest.raises(RuntimeError, match="without a BatchOutput"):
        sched.postprocess(batch, None)


def test_batch_ids_are_monotonic_and_pipelined_chunks_advance():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add(seq_of(range(10, 20)))
    batches = [sched.schedule() for _ in range(3)]
    assert [b.batch_id for b in batches] == [0, 1, 2]
    assert [b.work[0].context_len for b in batches] == [0, 4, 8]
    assert sched.schedule() is None  # waiting for the sampled token


def test_bad_requests_are_refused():
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq_of(range(8)))
    seq = seq_of([1])
    sched.add(seq)
    with pytest.raises(ValueError, match="already"):
        sched.add(seq)
    with pytest.raises(ValueError, match="KV blocks"):
        make_scheduler(max_model_len=64, num_kv_blocks=8)
    assert sched.abort("no-such-request") is None


def test_messages_and_sequences_pickle():
    sched = spec_scheduler()
    seq = seq_of(range(10, 16))
    sched.add(seq)
    batch = sched.schedule()
    assert pickle.loads(pickle.dumps(batch)) == batch
    output = answer(batch, drafts=[[1, 2, 3]])
    assert pickle.loads(pickle.dumps(output)) == output
    assert pickle.loads(pickle.dumps(seq)).token_ids == seq.token_ids
