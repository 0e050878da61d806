"""The scheduler driven by a toy runner that keeps a real paged token cache and a
"recurrent state" per slot (the tuple of tokens it has consumed).

The toy predicts the next token from the prefix it reads back through the block
table, so a wrong context, block table, prefix hit, state fork, save or commit
changes the generated text or trips an assertion. Outputs must equal plain
greedy generation.
"""

import random
from collections import deque

import pytest

from atom.config import EngineLimits
from atom.model_engine.batch import BatchOutput, ScheduledBatch, TokenChoice
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams

VOCAB = 50
EOS = 7
BLOCK = 4


def next_token(prefix: tuple[int, ...]) -> int:
    acc = 0
    for i, token in enumerate(prefix):
        acc = (acc * 31 + token * (i + 7)) % 1_000_003
    return acc % VOCAB


def reference(prompt: list[int], params: SamplingParams, max_model_len: int):
    tokens = list(prompt)
    while True:
        token = next_token(tuple(tokens))
        tokens.append(token)
        if token == EOS and not params.ignore_eos:
            return tokens[len(prompt) :]
        if len(tokens) - len(prompt) >= params.max_tokens:
            return tokens[len(prompt) :]
        if len(tokens) >= max_model_len:
            return tokens[len(prompt) :]


class ToyRunner:
    def __init__(self, sched: Scheduler, num_drafts: int, seed: int) -> None:
        self.kv: list[int | None] = [None] * (
            sched.block_manager.num_total_blocks * BLOCK
        )
        self.state: list[tuple[int, ...] | None] = [None] * sched.limits.num_state_slots
        self.snapshots: dict[int, list[tuple[int, ...]]] = {}
        self.num_drafts = num_drafts
        self.hybrid = sched.has_recurrent_state
        self.rng = random.Random(seed)
        self.num_forks = 0
        # (batch id, seq id -> (emitted tokens, accepted drafts, next drafts)) of
        # the last sampling batch: the inputs that async scheduling leaves pending,
        # and how many it did.
        self.sampled: tuple[int, dict[int, TokenChoice]] = (-1, {})
        self.num_pending_inputs = 0

    def _slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // BLOCK] * BLOCK + pos % BLOCK

    def execute(self, batch: ScheduledBatch) -> BatchOutput | None:
        for slot, rows in batch.spec_commits:
            self.state[slot] = self.snapshots.pop(slot)[rows - 1]
        # Pending rows, resolved as the runner does on the device: the previous
        # batch's anchor and drafts, the rejected drafts taken back from the
        # context, the state committed to the last accepted row.
        resolved = {}
        for work in batch.work:
            if not work.input_pending:
                continue
            sampled_in, choices = self.sampled
            assert sampled_in == batch.batch_id - 1, "pending input of an old batch"
            choice = choices[work.seq_id]
            rows = [choice.token_ids[-1], *choice.draft_token_ids][: work.num_rows]
            assert len(rows) == work.num_rows, "fewer drafts than the rows to fill"
            rejected = work.unconfirmed_drafts - choice.num_accepted
            assert rejected >= 0
            if work.unconfirmed_drafts:
                self.state[work.state_slot] = self.snapshots.pop(work.state_slot)[
                    choice.num_accepted
                ]
            resolved[work.seq_id] = (rows, work.context_len - rejected)
            self.num_pending_inputs += 1
        for work in batch.work:
            if work.state_fork_src is not None:
                self.state[work.state_slot] = self.state[work.state_fork_src]
                self.num_forks += 1
            elif work.context_len == 0:
                self.state[work.state_slot] = ()
        choices = []
        for work in batch.work:
            state = self.state[work.state_slot]
            targets, row_states = [], []
            rows, context_len = resolved.get(
                work.seq_id, (work.token_ids, work.context_len)
            )
            for i, token in enumerate(rows):
                pos = context_len + i
                self.kv[self._slot(work.block_table, pos)] = token
                prefix = tuple(
                    self.kv[self._slot(work.block_table, p)] for p in range(pos + 1)
                )
                # Without recurrent layers the "state" is the KV itself.
                state = state + (token,) if self.hybrid else prefix
                assert prefix == state, "recurrent state disagrees with the KV"
                row_states.append(state)
                targets.append(next_token(prefix))
            self.state[work.state_slot] = state
            if work.num_drafts:
                self.snapshots[work.state_slot] = row_states
            if not work.sample:
                continue
            base = len(work.token_ids) - 1 - work.num_drafts
            a = 0
            while a < work.num_drafts and (rows[base + 1 + a] == targets[base + a]):
                a += 1
            tokens = rows[base + 1 : base + 1 + a] + [targets[base + a]]
            committed = row_states[base + a] + (tokens[-1],)
            drafts = self._propose(committed, work.block_table)
            choices.append(TokenChoice(work.seq_id, tokens, a, drafts))
        for work in batch.work:
            if work.state_save_dst is not None:
                self.state[work.state_save_dst] = self.state[work.state_slot]
        if not choices:
            return None
        self.sampled = (batch.batch_id, {c.seq_id: c for c in choices})
        return BatchOutput(batch.batch_id, choices)

    def _propose(self, committed: tuple[int, ...], block_table: list[int]):
        if not self.num_drafts:
            return []
        # The drafter's block rows start at the anchor: their slots must exist.
        anchor_pos = len(committed) - 1
        for pos in range(anchor_pos, anchor_pos + self.num_drafts):
            self._slot(block_table, pos)
        drafts, prefix = [], committed
        for _ in range(self.num_drafts):
            token = next_token(prefix)
            if self.rng.random() < 0.3:
                token = (token + 1) % VOCAB
            drafts.append(token)
            prefix = prefix + (token,)
        return drafts


def make_requests(seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(14)]
    # Early bare heads: their KV and state checkpoints serve the later requests.
    requests = [
        (0, Sequence(shared[:8], SamplingParams(temperature=0, max_tokens=3))),
        (0, Sequence(shared[:12], SamplingParams(temperature=0, max_tokens=2))),
    ]
    for i in range(12):
        head = shared[: rng.choice([0, 5, 8, 12, 14])]
        tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 18))]
        params = SamplingParams(
            temperature=0, max_tokens=rng.randrange(1, 22), ignore_eos=i % 3 == 0
        )
        requests.append((rng.randrange(3, 30), Sequence(head + tail, params)))
    return requests


def simulate(sched: Scheduler, runner: ToyRunner, requests, depth: int):
    arrivals = sorted(requests, key=lambda r: r[0])
    in_flight: deque = deque()
    step = 0
    while arrivals or in_flight or not sched.is_finished():
        step += 1
        assert step < 5000, "the scheduler made no progress"
        while arrivals and arrivals[0][0] <= step:
            sched.add(arrivals.pop(0)[1])
        batch = sched.schedule() if len(in_flight) < depth else None
        if batch is not None:
            in_flight.append((batch, runner.execute(batch)))
        if in_flight and (batch is None or len(in_flight) >= depth):
            done, output = in_flight.popleft()
            sched.postprocess(done, output)


@pytest.mark.parametrize(
    "num_drafts, hybrid, depth, num_blocks, run_ahead",
    [
        (0, False, 1, 64, False),
        (0, False, 2, 16, False),
        (3, False, 1, 16, False),
        (3, True, 2, 64, False),
        (0, True, 1, 16, False),
        (2, True, 2, 16, False),
        # Async scheduling: two batches in flight on one "device".
        (0, False, 2, 64, True),
        (0, True, 2, 16, True),
        # ... with drafts: the rejected ones are taken back on the "device".
        (3, False, 2, 64, True),
        (3, True, 2, 16, True),
        (2, True, 2, 64, True),
    ],
)
def test_generation_matches_greedy_reference(
    num_drafts, hybrid, depth, num_blocks, run_ahead
):
    max_model_len = 40
    limits = EngineLimits(
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=max_model_len,
        block_size=BLOCK,
        num_speculative_tokens=num_drafts,
        num_state_checkpoints=3,
        async_scheduling=run_ahead,
    )
    sched = Scheduler(limits, num_blocks, has_recurrent_state=hybrid, eos_token_id=EOS)
    runner = ToyRunner(sched, num_drafts, seed=num_blocks + depth)
    requests = make_requests(seed=7)
    simulate(sched, runner, requests, depth)
    for _, seq in requests:
        expected = reference(seq.prompt_token_ids, seq.sampling_params, max_model_len)
        assert seq.output_token_ids == expected, seq
        assert seq.is_finished
    stats = sched.stats()
    assert stats["kv_cache_blocks_used"] == 0 and stats["requests_running"] == 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["prompt_tokens"] == sum(s.num_prompt_tokens for _, s in requests)
    assert stats["generation_tokens"] == sum(s.num_output_tokens for _, s in requests)
    if num_blocks == 16:
        assert stats["preemptions"] > 0
    if hybrid:
        assert runner.num_forks > 0
    assert (runner.num_pending_inputs > 0) == run_ahead
    if num_drafts:
        spec = sched.spec_stats
        assert 0 < spec.total_accepted_tokens < spec.total_draft_tokens
