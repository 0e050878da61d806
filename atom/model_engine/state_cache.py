"""Scheduler-side bookkeeping of recurrent (KDA) state slots; the tensors live in
the runner, which sizes them as request slots followed by checkpoint slots.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class StateSlotAllocator:
    """Per-request state slots 0..num_request_slots-1."""

    def __init__(self, num_request_slots: int) -> None:
        if num_request_slots < 1:
            raise ValueError(
                f"StateSlotAllocator needs num_request_slots >= 1, "
                f"got {num_request_slots}"
            )
        self.num_slots = num_request_slots
        self._free: deque[int] = deque(range(num_request_slots))
        self._used: set[int] = set()

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} request state slots are in use")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)


class StateCheckpointPool:
    """Checkpoint slots first_slot..first_slot+num_slots-1, keyed by block hash.

    The state in a slot is the one reached at the END of the block with that hash
    (the hash chain names the whole prefix). Least recently used entries are
    evicted. Reservations made while building a batch stay invisible to `lookup`
    and cannot be evicted until `publish()`: the state is only saved after that
    batch's forward, and two saves must never target one slot in one batch.
    """

    def __init__(self, first_slot: int, num_slots: int) -> None:
        if first_slot < 0 or num_slots < 0:
            raise ValueError(
                f"StateCheckpointPool needs first_slot >= 0 and num_slots >= 0, "
                f"got {first_slot} and {num_slots}"
            )
        self.first_slot = first_slot
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU first
        self._free: deque[int] = deque(range(first_slot, first_slot + num_slots))
        self._pending: set[int] = set()

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: int) -> bool:
        """Whether a checkpoint exists or is being saved for this hash."""
        return block_hash in self._slot_of

    def lookup(self, block_hash: int) -> int | None:
        """Slot holding the state at the end of that block, or None."""
        if block_hash in self._pending:
            return None
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._slot_of.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: int) -> int | None:
        """Slot to save that state into (evicting the LRU entry), or None if every
        slot is already reserved in the batch being built."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._slot_of.move_to_end(block_hash)
            return slot
        if not self._free:
            victim = next((h for h in self._slot_of if h not in self._pending), None)
            if victim is None:
                return None
            self._free.append(self._slot_of.pop(victim))
        slot = self._free.popleft()
        self._slot_of[block_hash] = slot
        self._pending.add(block_hash)
        return slot

    def publish(self) -> None:
        """The batch holding the pending saves is scheduled; later batches may fork."""
        self._pending.clear()

    def invalidate(self, block_hash: int) -> None:
        """Drop the checkpoint: its block's KV is no longer cached.

        A pending entry stays: the sequence saving it registers its own block with
        this hash before `publish()`.
        """
        if block_hash in self._pending:
            return
        slot = self._slot_of.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
