"""Prefix caching with a recurrent-state (KDA) model: KV hits are usable only up to
a block boundary whose state was checkpointed."""

from atom.model_engine.scheduler import Scheduler
from tests.model_engine.scheduler_helpers import (
    answer,
    make_scheduler,
    run_until_sampled,
    seq_of,
)


def hybrid_scheduler(**overrides) -> Scheduler:
    args = dict(has_recurrent_state=True, num_state_checkpoints=2)
    args.update(overrides)
    return make_scheduler(**args)


def test_hybrid_prefill_ends_a_chunk_at_the_last_full_block_and_saves_state():
    sched = hybrid_scheduler()
    seq = seq_of(range(10, 20))
    sched.add(seq)
    first = sched.schedule()
    (work,) = first.work
    assert (work.context_len, len(work.token_ids), work.sample) == (0, 8, False)
    assert work.state_save_dst is not None
    limits = sched.limits
    assert limits.max_num_seqs <= work.state_save_dst < limits.num_state_slots
    (rest,) = sched.schedule().work
    assert (rest.context_len, rest.token_ids, rest.sample) == (8, [18, 19], True)
    assert rest.state_save_dst is None and rest.state_fork_src is None


def test_hybrid_hit_forks_the_saved_state():
    sched = hybrid_scheduler()
    sched.add(seq_of(range(10, 20)))
    first = sched.schedule()
    save_slot = first.work[0].state_save_dst
    run_until_sampled(sched)
    again = seq_of(list(range(10, 20)) + [3])
    sched.add(again)
    (work,) = sched.schedule().work
    assert (work.context_len, work.state_fork_src) == (8, save_slot)
    assert work.state_slot != save_slot and work.state_save_dst is None


def test_hybrid_hit_is_cut_back_to_a_checkpointed_boundary():
    sched = hybrid_scheduler()
    a = seq_of(range(10, 20), max_tokens=20)
    sched.add(a)
    save_slot = sched.schedule().work[0].state_save_dst
    run_until_sampled(sched)
    for token in range(60, 67):  # decode to 17 tokens: blocks 2 and 3 become full
        step = sched.schedule()
        sched.postprocess(step, answer(step, [[token]]))
    probe = seq_of(a.token_ids[:16] + [1, 1])
    assert sched.block_manager.num_cached_prefix_blocks(probe) == 4
    sched.add(probe)
    (work,) = sched.schedule().work
    # KV exists for 16 tokens, but the only saved state is at token 8.
    assert (work.context_len, work.state_fork_src) == (8, save_slot)
    no_state = seq_of(a.token_ids[:4] + [9, 9, 9, 9, 9])
    sched.add(no_state)
    (work,) = [w for w in sched.schedule().work if w.seq_id == no_state.seq_id]
    assert (work.context_len, work.state_fork_src) == (0, None)


def test_hybrid_same_prompt_in_one_batch_does_not_fork_a_pending_save():
    sched = hybrid_scheduler()
    a, b = seq_of(range(10, 20)), seq_of(range(10, 20))
    sched.add(a)
    sched.add(b)
    works = sched.schedule().work
    assert [w.state_fork_src for w in works] == [None, None]
    # One save is enough: b sees the reservation and runs its prompt unsplit.
    assert works[0].state_save_dst is not None and len(works[0].token_ids) == 8
    assert works[1].state_save_dst is None and len(works[1].token_ids) == 8


def test_checkpoint_is_invalidated_when_its_block_is_reused():
    sched = hybrid_scheduler(max_model_len=16, num_kv_blocks=4)
    a = seq_of(range(10, 19), max_tokens=1)
    sched.add(a)
    run_until_sampled(sched)
    saved_hash = sched.block_manager.block_hash(a, 1)
    assert a.is_finished and sched.checkpoints.lookup(saved_hash) is not None
    filler = seq_of(range(30, 44), max_tokens=1)  # needs all 4 blocks
    sched.add(filler)
    run_until_sampled(sched)
    assert saved_hash not in sched.checkpoints
    assert len(sched.checkpoints) == 1  # the filler's own checkpoint
    again = seq_of(range(10, 19))
    sched.add(again)
    (work,) = sched.schedule().work
    assert (work.context_len, work.state_fork_src) == (0, None)
