"""Continuous batching over paged KV blocks, recurrent-state slots and drafts.

Policy (as nano-vllm and ATOM): prefill first. A batch is either a prefill batch
(chunks of sequences with more than one uncomputed token, plus new admissions) or
a decode batch (`[last]` plus up to T drafts per sequence), never both, so every
row of a verify forward is verify-shaped. New prompts may wait a moment while
others decode, so that arrivals share one prefill batch (`prefill_pacer.py`).

Several batches may be in flight (pipeline parallelism): a prefill chunk advances
`num_computed_tokens` when it is scheduled, so the next chunk can follow at once,
while a sequence waiting for sampled tokens has nothing left to run and is skipped
until `postprocess` appends them. Every stage runs batches in `batch_id` order,
which is what makes scheduling ahead of the outputs safe.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from atom.model_engine.batch import (
    BatchOutput,
    LogitAdjustWork,
    ScheduledBatch,
    SeqWork,
)
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.prefill_pacer import PrefillPacer
from atom.model_engine.run_ahead import runs_ahead
from atom.model_engine.sequence import Sequence, SequenceStatus
from atom.model_engine.state_cache import StateCheckpointPool, StateSlotAllocator
from atom.spec_decode.metrics import SpecDecodeStats

if TYPE_CHECKING:
    from atom.config import EngineLimits
    from atom.kv_transfer.connector import KVConnectorOutput, KVConnectorScheduler

logger = logging.getLogger(__name__)


def useful_drafts(work: SeqWork, seq: Sequence) -> int:
    """The drafts of a verify that can still become output: a verify emits the
    accepted drafts and one more token, so with r tokens left under max_tokens
    (before the step's tokens are appended) at most r - 1 drafts count."""
    if not work.num_drafts:
        return 0
    remaining = seq.sampling_params.max_tokens - seq.num_output_tokens
    return max(0, min(work.num_drafts, remaining - 1))


class Scheduler:
    def __init__(
        self,
        limits: EngineLimits,
        num_kv_blocks: int,
        has_recurrent_state: bool = False,
        eos_token_id: int | Iterable[int] | None = None,
        connector: KVConnectorScheduler | None = None,
        pacer: PrefillPacer | None = None,
    ) -> None:
        limits.check_kv_blocks(num_kv_blocks)
        # P/D (docs/pd.md): None on an engine that moves no KV.
        self.connector = connector
        self.limits = limits
        self.has_recurrent_state = has_recurrent_state
        eos = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos_token_ids = frozenset(eos or ())
        # Admission of new prompts while others decode (prefill_pacer.py).
        self.pacer = pacer or PrefillPacer(0.0)

        # A model without recurrent state resumes any cached prefix from its KV alone.
        num_checkpoints = limits.num_state_checkpoints if has_recurrent_state else 0
        self.checkpoints = StateCheckpointPool(limits.max_num_seqs, num_checkpoints)
        self.block_manager = BlockManager(
            num_kv_blocks,
            limits.block_size,
            limits.enable_prefix_caching,
            on_hash_evicted=self.checkpoints.invalidate,
        )
        self.state_slots = StateSlotAllocator(limits.max_num_seqs)
        self.spec_stats = (
            SpecDecodeStats(limits.num_speculative_tokens)
            if limits.num_speculative_tokens
            else None
        )

        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # P/D consumer: admitted, waiting for their KV (count toward max_num_seqs).
        self.parked: list[Sequence] = []
        # P/D producer: finished requests whose blocks wait for the consumer,
        # by transfer id, with the monotonic time their lease ends.
        self.held: dict[int, tuple[Sequence, float]] = {}
        self._live: dict[int, Sequence] = {}
        self._by_request: dict[str, Sequence] = {}
        self._next_batch_id = 0
        self._pending_commits: dict[int, tuple[int, int]] = {}
        self._pending_finished: list[int] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # ---- requests ----
    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING or seq.seq_id in self._live:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        if seq.request_id in self._by_request:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if seq.num_tokens >= self.limits.max_model_len:
            raise ValueError(
                f"prompt of {seq.num_tokens} tokens leaves no room to generate "
                f"within max_model_len={self.limits.max_model_len}"
            )
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq
        self._by_request[seq.request_id] = seq
        self.num_prompt_tokens += seq.num_prompt_tokens

    def abort(self, request_id: str, finish_reason: str = "abort") -> Sequence | None:
        """Finish a request now (also used for stop strings); None if unknown."""
        seq = self._by_request.get(request_id)
        if seq is not None:
            self._finish(seq, finish_reason)
        return seq

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.parked

    def stats(self) -> dict[str, int | float]:
        """Gauges and counters for /metrics (entrypoints/openai/metrics.py names them)."""
        bm = self.block_manager
        return {
            "requests_running": len(self.running),
            "requests_waiting": len(self.waiting) + len(self.parked),
            "kv_cache_blocks_used": bm.num_used_blocks,
            "kv_cache_blocks_free": bm.num_free_blocks,
            "kv_cache_blocks_total": bm.num_total_blocks,
            "kv_cache_usage_ratio": bm.usage,
            "preemptions": self.num_preemptions,
            "prefix_cache_queried_tokens": bm.num_queried_tokens,
            "prefix_cache_hit_tokens": bm.num_hit_tokens,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
        }

    # ---- scheduling ----
    def schedule(self) -> ScheduledBatch | None:
        prefill = self._schedule_prefill()
        works = prefill or self._schedule_decode()
        if not works:
            return None
        batch = ScheduledBatch(
            batch_id=self._next_batch_id,
            work=works,
            spec_commits=list(self._pending_commits.values()),
            finished_seq_ids=self._pending_finished,
        )
        self._next_batch_id += 1
        if prefill:
            self.pacer.started(batch.batch_id)
        self._pending_commits = {}
        self._pending_finished = []
        for work in works:
            if work.sample:
                self._live[work.seq_id].in_flight_batch_ids.append(batch.batch_id)
        return batch

    def _schedule_prefill(self) -> list[SeqWork]:
        budget = self.limits.max_num_batched_tokens
        works: list[SeqWork] = []
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1:
                work = self._next_chunk(seq, budget)
                if work is not None:
                    works.append(work)
                    budget -= work.num_rows
        max_num_seqs = self.limits.max_num_seqs
        # A prompt admitted while others decode stalls them for a step: once the
        # oldest has waited its turn, every waiting prompt shares that step.
        held = bool(self.waiting and self.running and not works) and not (
            self.pacer.admits(self.waiting[0].arrival_time)
        )
        while (
            not held
            and self.waiting
            and budget > 0
            and len(self.running) + len(self.parked) < max_num_seqs
        ):
            seq = self.waiting[0]
            if self._receives_kv(seq):
                if not self._admit_remote(seq):
                    break
                self.waiting.popleft()
                continue
            if not self._admit(seq, budget):
                break
            self.waiting.popleft()
            self.running.append(seq)
            work = self._next_chunk(seq, budget)
            works.append(work)
            budget -= work.num_rows
        # Blocks and checkpoints written by this batch become hits only for later
        # batches: nothing guarantees a forward reads rows it writes itself.
        for work in works:
            seq = self._live[work.seq_id]
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
        self.checkpoints.publish()
        return works

    def _admit(self, seq: Sequence, budget: int) -> bool:
        if not self.state_slots.can_allocate():
            return False
        num_cached_blocks, fork_src = self._usable_prefix(seq)
        bm = self.block_manager
        if self._chunk_plan(seq, num_cached_blocks * bm.block_size, budget) is None:
            return False
        lookahead = self.limits.num_speculative_tokens
        if not bm.can_allocate(seq, num_cached_blocks, lookahead):
            return False
        bm.allocate(seq, num_cached_blocks, lookahead)
        seq.state_slot = self.state_slots.allocate()
        seq.state_fork_src = fork_src
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        # A preempted sequence is admitted again; its queue time ends the first time.
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        return True

    def _receives_kv(self, seq: Sequence) -> bool:
        if self.connector is None:
            return False
        return self.connector.get_num_new_matched_tokens(seq)[1]

    def _admit_remote(self, seq: Sequence) -> bool:
        """Allocate for a request whose prompt KV comes from a producer and park it;
        the whole prompt arrives (no prefix reuse: its KDA state comes along)."""
        bm = self.block_manager
        lookahead = self.limits.num_speculative_tokens
        if not self.state_slots.can_allocate() or not bm.can_allocate(
            seq, 0, lookahead
        ):
            return False
        bm.allocate(seq, 0, lookahead)
        seq.state_slot = self.state_slots.allocate()
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        self.parked.append(seq)
        self.connector.update_state_after_alloc(seq)
        return True

    def finish_receives(self, result: KVConnectorOutput) -> list[Sequence]:
        """Apply one round of receives: a received request runs on from the first
        token the producer sampled; a failed one is prefilled here instead.
        Returns the requests that received (their first token is new output)."""
        received = []
        for seq in list(self.parked):
            if seq.seq_id in result.failed_recving:
                logger.warning(
                    "KV receive failed for request %s: %s; falling back to prefill",
                    seq.request_id,
                    result.failed_recving[seq.seq_id],
                )
                self.connector.request_received(seq, ok=False)
                self._unpark(seq)
                seq.kv_transfer_params = None
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
            elif seq.seq_id in result.finished_recving:
                self.connector.request_received(seq, ok=True)
                self.parked.remove(seq)
                self.running.append(seq)
                seq.status = SequenceStatus.RUNNING
                seq.num_computed_tokens = seq.num_prompt_tokens
                first = int(seq.kv_transfer_params["first_token_id"])
                seq.kv_transfer_params = None  # a preemption recomputes it here
                reason = seq.append_tokens(
                    [first], self.eos_token_ids, self.limits.max_model_len
                )
                self.num_generation_tokens += 1
                if reason is not None:
                    self._finish(seq, reason)
                received.append(seq)
        return received

    def bootstrap_works(self, seqs: list[Sequence]) -> list[SeqWork]:
        """For received requests: the row that decided each first token (the
        prompt's last, at its position), to anchor their first proposal at."""
        return [
            self._work(
                seq,
                token_ids=[seq.token_ids[seq.num_prompt_tokens - 1]],
                context_len=seq.num_prompt_tokens - 1,
            )
            for seq in seqs
        ]

    def _unpark(self, seq: Sequence) -> None:
        self.parked.remove(seq)
        self.block_manager.deallocate(seq)
        self.state_slots.free(seq.state_slot)
        seq.state_slot = None

    def release_transfer(self, transfer_id: int) -> bool:
        """Free the blocks and state slot a producer held for a consumer; False if
        it holds none under that id (released already, or its lease ran out)."""
        held = self.held.pop(transfer_id, None)
        if held is None:
            return False
        seq = held[0]
        self.block_manager.deallocate(seq)
        self.state_slots.free(seq.state_slot)
        seq.state_slot = None
        return True

    def expire_leases(self, now: float) -> list[int]:
        """Release every held transfer whose lease ended by `now`; their ids."""
        expired = [tid for tid, (_, deadline) in self.held.items() if deadline <= now]
        for transfer_id in expired:
            logger.warning(
                "transfer %d was never pulled: its blocks are freed", transfer_id
            )
            self.release_transfer(transfer_id)
        return expired

    def _usable_prefix(self, seq: Sequence) -> tuple[int, int | None]:
        """(cached blocks to reuse, checkpoint slot to fork the state from)."""
        if seq.needs_prompt_logprobs:
            return 0, None
        num_blocks = self.block_manager.num_cached_prefix_blocks(seq)
        if not self.has_recurrent_state:
            return num_blocks, None
        # KV alone cannot resume a recurrent layer: cut back to a saved state.
        for j in range(num_blocks, 0, -1):
            slot = self.checkpoints.lookup(self.block_manager.block_hash(seq, j - 1))
            if slot is not None:
                return j, slot
        return 0, None

    def _chunk_plan(
        self, seq: Sequence, start: int, budget: int
    ) -> tuple[int, int | None] | None:
        """(end of the next prefill chunk, hash to checkpoint there or None), or None
        when the chunk does not fit the budget and may not be split."""
        end = seq.num_tokens
        save_hash = None
        if self.checkpoints.num_slots:
            # The state at the prompt's last full-block boundary makes the next
            # request with this prefix resumable, so a chunk ends exactly there.
            num_blocks = seq.num_prompt_tokens // self.block_manager.block_size
            boundary = num_blocks * self.block_manager.block_size
            if boundary > start:
                block_hash = self.block_manager.block_hash(seq, num_blocks - 1)
                if block_hash not in self.checkpoints:
                    end, save_hash = boundary, block_hash
        if end - start > budget:
            if not self.limits.enable_chunked_prefill:
                return None
            end, save_hash = start + budget, None
        return end, save_hash

    def _next_chunk(self, seq: Sequence, budget: int) -> SeqWork | None:
        start = seq.num_computed_tokens
        plan = self._chunk_plan(seq, start, budget)
        if plan is None:
            return None
        end, save_hash = plan
        save_dst = None if save_hash is None else self.checkpoints.reserve(save_hash)
        fork_src, seq.state_fork_src = seq.state_fork_src, None
        seq.num_computed_tokens = end
        return self._work(
            seq,
            token_ids=seq.token_ids[start:end],
            context_len=start,
            sample=end == seq.num_tokens,
            state_fork_src=fork_src,
            state_save_dst=save_dst,
        )

    def _schedule_decode(self) -> list[SeqWork]:
        budget = self.limits.max_num_batched_tokens
        works: list[SeqWork] = []
        scheduled: set[int] = set()
        previous = self._next_batch_id - 1
        for seq in list(self.running):  # _make_room may preempt
            # Async scheduling: its input is the token the previous batch samples.
            pending = runs_ahead(seq, self.limits, previous)
            if seq.num_uncomputed_tokens != 1 and not pending:
                continue
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for an earlier one
            if pending:
                # The previous batch emits at most drafts_in_flight + 1 tokens and
                # proposes T drafts after them (run_ahead.py).
                unconfirmed = seq.drafts_in_flight
                num_drafts = self.limits.num_speculative_tokens
                pending_rows = unconfirmed + 1
            else:
                unconfirmed, pending_rows = 0, 0
                num_drafts = self._num_drafts_to_verify(seq)
            if 1 + num_drafts > budget:
                break
            if not self._make_room(seq, num_drafts + pending_rows, scheduled):
                continue
            start = seq.num_computed_tokens + unconfirmed
            seq.num_computed_tokens += 1
            if pending:  # placeholders the runner fills on the device
                rows = [0] * (1 + num_drafts)
            else:
                rows = [seq.last_token] + seq.spec_token_ids[:num_drafts]
            works.append(
                self._work(
                    seq,
                    token_ids=rows,
                    context_len=start,
                    num_drafts=num_drafts,
                    input_pending=pending,
                    unconfirmed_drafts=unconfirmed,
                )
            )
            scheduled.add(seq.seq_id)
            budget -= len(rows)
        return works

    def _num_drafts_to_verify(self, seq: Sequence) -> int:
        """The drafts to verify: all the drafter proposed (at most T), within
        max_model_len (rows past it have no cache slot).

        Drafts past max_tokens are verified too: a sequence near its end then keeps
        the batch's uniform T + 1 rows, so the step still replays a CUDA graph
        instead of running eagerly (one such sequence would take the whole batch
        off its graph). The tokens they yield are cut by `append_tokens` and not
        counted (`useful_drafts`)."""
        if not self.limits.num_speculative_tokens:
            return 0
        room = self.limits.max_model_len - seq.num_tokens
        limit = min(self.limits.num_speculative_tokens, len(seq.spec_token_ids))
        return max(0, min(limit, room - 1))

    def _make_room(self, seq: Sequence, num_rows: int, taken: set[int]) -> bool:
        """Blocks for the rows after the last token (drafts to verify, a pending
        token) and the drafter's block rows, preempting the latest admitted
        sequences if needed; False if seq itself was preempted."""
        num_new = num_rows + self.limits.num_speculative_tokens
        while not self.block_manager.try_append(seq, num_new):
            victims = [
                s for s in self.running if s is not seq and s.seq_id not in taken
            ]
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(victims[-1])
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free everything the sequence holds; it is recomputed from scratch later.
        An output still in flight for it is ignored by postprocess."""
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        self.state_slots.free(seq.state_slot)
        seq.state_slot = None
        seq.state_fork_src = None
        seq.in_flight_batch_ids = []
        self._pending_commits.pop(seq.seq_id, None)

    def _work(self, seq: Sequence, **rows) -> SeqWork:
        """The sequence's SeqWork: its rows (`rows`) with its table, slot and sampling."""
        sp = seq.sampling_params
        samples = rows.get("sample", True)
        seq.drafts_in_flight = rows.get("num_drafts", 0)
        if seq.needs_prompt_logprobs:
            # Also on a decode-shaped work: a prefill whose last chunk is one token
            # runs as decode, and its sampled step must carry the flag.
            start = rows["context_len"]
            end = start + len(rows["token_ids"])
            # Row i (position start + i) predicts the token at start + i + 1.
            rows["prompt_logprobs"] = sp.prompt_logprobs
            rows["prompt_logprob_targets"] = seq.token_ids[
                start + 1 : min(end + 1, seq.num_prompt_tokens)
            ]
        return SeqWork(
            seq_id=seq.seq_id,
            block_table=list(seq.block_table),
            state_slot=seq.state_slot,
            temperature=sp.temperature,
            top_k=sp.top_k,
            top_p=sp.top_p,
            seed=sp.seed,
            logit_adjust=(
                LogitAdjustWork.for_sequence(seq, self.eos_token_ids)
                if samples and sp.adjusts_logits
                else None
            ),
            logprobs=sp.logprobs if samples else None,
            **rows,
        )

    # ---- results ----
    def postprocess(
        self, batch: ScheduledBatch, output: BatchOutput | None
    ) -> list[Sequence]:
        """Apply one batch's output; returns the sequences that finished."""
        self.pacer.finished(batch.batch_id, sampled=output is not None)
        works = [work for work in batch.work if work.sample]
        if output is None:
            if works:
                raise RuntimeError(
                    f"batch {batch.batch_id} samples sequences "
                    f"{batch.sample_seq_ids} but was postprocessed without a BatchOutput"
                )
            return []
        output.check_against(batch, self.limits.num_speculative_tokens)
        finished = []
        for work, choice in zip(works, output.choices):
            accepted = choice.num_accepted
            seq = self._live.get(work.seq_id)
            if seq is None or batch.batch_id not in seq.in_flight_batch_ids:
                continue  # aborted or preempted while the batch ran
            seq.in_flight_batch_ids.remove(batch.batch_id)
            useful = useful_drafts(work, seq)
            if useful:
                # Counted before stop truncation: it measures the drafter.
                self.spec_stats.record(useful, min(accepted, useful))
            seq.num_computed_tokens += accepted
            num_before = seq.num_tokens
            reason = seq.append_tokens(
                choice.token_ids, self.eos_token_ids, self.limits.max_model_len
            )
            appended = seq.num_tokens - num_before
            self.num_generation_tokens += appended
            if choice.logprobs is not None:
                seq.output_logprobs.extend(choice.logprobs[:appended])
            if choice.prompt_logprobs is not None and seq.needs_prompt_logprobs:
                if len(choice.prompt_logprobs) != seq.num_prompt_tokens - 1:
                    raise RuntimeError(
                        f"sequence {seq.seq_id}: {len(choice.prompt_logprobs)} prompt "
                        f"logprobs for a prompt of {seq.num_prompt_tokens} tokens"
                    )
                seq.prompt_logprobs = [None, *choice.prompt_logprobs]
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
                continue
            seq.spec_token_ids = list(choice.draft_token_ids)
            # A sequence already running ahead had this state committed on the
            # device, before its next verify (run_ahead.py).
            if work.num_drafts and not seq.in_flight_batch_ids:
                self._pending_commits[seq.seq_id] = (seq.state_slot, accepted + 1)
        return finished

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.status is SequenceStatus.RUNNING:
            if not self._hold_for_transfer(seq):
                self._release(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
            self._unpark(seq)
            self.connector.abort(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        del self._live[seq.seq_id]
        del self._by_request[seq.request_id]
        self._pending_finished.append(seq.seq_id)

    def _hold_for_transfer(self, seq: Sequence) -> bool:
        """P/D producer: keep a finished request's blocks and state slot for the
        consumer, under a lease; its output carries where they are."""
        if self.connector is None:
            return False
        hold, params = self.connector.request_finished(seq)
        if not hold:
            return False
        seq.kv_transfer_output = params
        self.running.remove(seq)
        seq.in_flight_batch_ids = []
        self._pending_commits.pop(seq.seq_id, None)
        self.held[seq.seq_id] = (seq, self.connector.lease_deadline())
        return True
