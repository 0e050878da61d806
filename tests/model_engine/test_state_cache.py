import pytest

from atom.model_engine.state_cache import StateCheckpointPool, StateSlotAllocator


def test_request_slots_are_handed_out_and_returned():
    slots = StateSlotAllocator(2)
    a, b = slots.allocate(), slots.allocate()
    assert {a, b} == {0, 1} and not slots.can_allocate()
    with pytest.raises(RuntimeError, match="in use"):
        slots.allocate()
    slots.free(a)
    assert slots.allocate() == a
    with pytest.raises(ValueError, match="not allocated"):
        slots.free(7)


def test_checkpoints_use_their_own_slot_range_and_evict_lru():
    pool = StateCheckpointPool(first_slot=4, num_slots=2)
    first, second = pool.reserve(101), pool.reserve(102)
    assert {first, second} == {4, 5}
    pool.publish()
    assert pool.lookup(101) == first  # 101 is now the most recently used
    third = pool.reserve(103)
    assert third == second and 102 not in pool and pool.lookup(101) == first


def test_reservations_stay_invisible_and_unevictable_until_published():
    pool = StateCheckpointPool(first_slot=0, num_slots=1)
    slot = pool.reserve(7)
    assert 7 in pool and pool.lookup(7) is None
    assert pool.reserve(8) is None  # would overwrite a save of the same batch
    assert pool.reserve(7) == slot
    pool.invalidate(7)  # the saving sequence registers its block again
    pool.publish()
    assert pool.lookup(7) == slot


def test_invalidate_frees_the_slot():
    pool = StateCheckpointPool(first_slot=3, num_slots=1)
    pool.reserve(1)
    pool.publish()
    pool.invalidate(1)
    assert pool.lookup(1) is None and len(pool) == 0
    assert pool.reserve(2) == 3
