"""StepSampler: per-step metadata from the scheduler's work, sampling and verifying
all sequences at once, the draft distributions it keeps, and the engine's seeds."""

import pytest
import torch

from atom import LLMEngine, SamplingParams
from atom.kernels import triton_available
from atom.model_engine.batch import SeqWork
from atom.model_engine.step_sampler import StepSampler
from atom.model_ops.rejection_sampler import verify_drafts
from atom.model_ops.sampler import sample_tokens
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.spec_decode.draft_output import DraftOutput
from tests.spec_decode.spec_helpers import ENGINE_SETTINGS, spec_engine

VOCAB = 40


def work(seq_id, token_ids, context_len, sample=True, drafts=0, temperature=0.8):
    return SeqWork(
        seq_id=seq_id,
        token_ids=token_ids,
        context_len=context_len,
        block_table=list(range(seq_id, seq_id + 1 + context_len // 16)),
        state_slot=seq_id,
        sample=sample,
        num_drafts=drafts,
        temperature=temperature,
        top_k=-1,
        top_p=1.0,
        seed=None if temperature == 0 else 100 + seq_id,
    )


def scored_logits(sampling: SamplingMetadata, num_rows: int) -> torch.Tensor:
    """Logits of every row of the forward, then the scored ones."""
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(num_rows, VOCAB, generator=gen) * 2)[sampling.logit_rows]


def fields_of(sampling: SamplingMetadata) -> dict:
    return {
        name: value.tolist() if isinstance(value, torch.Tensor) else value
        for name, value in vars(sampling).items()
        if name not in ("spec", "plain_decode")
    }


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_steady_decode_reuses_the_last_steps_metadata(temperature):
    def step(context_len: int, ids=(1, 2, 3)) -> list[SeqWork]:
        return [work(i, [7], context_len + i, temperature=temperature) for i in ids]

    first = SamplingMetadata.from_works(step(10), "cpu", drafts_next=False)
    assert first.plain_decode
    again = SamplingMetadata.from_works(
        step(11), "cpu", drafts_next=False, previous=first
    )
    fresh = SamplingMetadata.from_works(step(11), "cpu", drafts_next=False)
    assert fields_of(again) == fields_of(fresh)
    assert again.temperatures is first.temperatures
    # Other sequences, or a step that is not plain decode, build afresh.
    other = SamplingMetadata.from_works(
        step(11, (1, 3)), "cpu", drafts_next=False, previous=first
    )
    assert other.seq_ids == [1, 3] and other.temperatures is not first.temperatures
    verify = [work(1, [7, 8], 11, drafts=1, temperature=temperature)]
    built = SamplingMetadata.from_works(
        verify, "cpu", drafts_next=False, previous=first
    )
    assert not built.plain_decode and built.spec.max_drafts == 1


def test_metadata_from_works_selects_rows_positions_and_drafts():
    works = [
        work(0, [5, 6, 7], 0, sample=False),  # a prefill chunk that samples nothing
        work(1, [8, 9], 10),  # the last chunk of a prefill
        work(2, [4, 11, 12, 13], 20, drafts=3),  # verify: [last, d1, d2, d3]
        work(3, [1, 2], 7, drafts=1, temperature=0),
    ]
    sampling = SamplingMetadata.from_works(works, "cpu", drafts_next=True)
    assert sampling.seq_ids == [1, 2, 3]
    assert sampling.logit_rows.tolist() == [4, 5, 6, 7, 8, 9, 10]
    # The position each sequence's first scored row predicts.
    assert sampling.positions.tolist() == [12, 21, 8]
    assert sampling.greedy_host == [False, False, True]
    spec = sampling.spec
    assert spec.num_drafts_host == [0, 3, 1] and spec.max_drafts == 3
    assert spec.draft_ids.tolist() == [[0, 0, 0], [11, 12, 13], [2, 0, 0]]
    assert spec.row_index.tolist() == [[0, 0, 0, 0], [1, 2, 3, 4], [5, 6, 6, 6]]
    assert spec.block_tables.shape == (3, 2)
    # An engine that drafts nothing sends no block tables.
    plain = SamplingMetadata.from_works(works, "cpu", drafts_next=False)
    assert plain.spec.block_tables is None
    assert plain.spec.row_index.tolist() == spec.row_index.tolist()


def test_a_plain_step_samples_every_sequence_once():
    works = [work(0, [5, 6, 7], 0), work(1, [3], 9, temperature=0)]
    sampling = SamplingMetadata.from_works(works, "cpu", drafts_next=False)
    logits = scored_logits(sampling, 4)
    choices = StepSampler().launch(logits, sampling).choices()
    expected = sample_tokens(logits, sampling).tolist()
    assert [c.seq_id for c in choices] == [0, 1]
    assert [c.token_ids for c in choices] == [[t] for t in expected]
    assert [c.num_accepted for c in choices] == [0, 0]
    assert [c.draft_token_ids for c in choices] == [[], []]
    assert expected[1] == int(logits[1].argmax())


def test_verification_uses_the_stored_draft_distributions():
    works = [
        work(0, [4, 11, 12], 20, drafts=2),
        work(1, [6], 3),  # no drafts this step
        work(2, [9, 30], 5, drafts=1, temperature=0),
    ]
    sampling = SamplingMetadata.from_works(works, "cpu", drafts_next=False)
    logits = scored_logits(sampling, 6)
    sampler = StepSampler()
    with pytest.raises(RuntimeError, match="sequence 0 verifies 2 sampled drafts"):
        sampler.launch(logits, sampling).choices()

    q = torch.softmax(torch.randn(3, 3, VOCAB, generator=torch.Generator()), -1)
    proposed_by = SamplingMetadata.build([0.8, 0.8, 0.0], seeds=[1, 1, None])
    ids = torch.zeros(3, 3, dtype=torch.long)
    sampler.store_draft_probs(proposed_by, DraftOutput(ids, q))
    # Only temperature > 0 requests keep their q.
    assert sorted(sampler.draft_probs) == [0, 1]
    choices = sampler.launch(logits, sampling).choices()

    spec = sampling.spec
    unused = torch.zeros(2, VOCAB)
    emitted, accepted = verify_drafts(
        logits[spec.row_index],
        spec.draft_ids,
        spec.num_drafts,
        torch.stack([q[0, :2], unused, unused]),
        sampling,
    )
    for choice, tokens, count in zip(choices, emitted.tolist(), accepted.tolist()):
        assert choice.num_accepted == count
        assert choice.token_ids == tokens[: count + 1]
    sampler.forget([0, 1])
    assert not sampler.draft_probs


def test_a_sequence_chooses_the_same_alone_and_in_a_batch():
    batch = [work(0, [3, 4], 0), work(1, [7], 30), work(2, [1, 2, 3], 12)]
    logits_of = {}
    together = SamplingMetadata.from_works(batch, "cpu", drafts_next=False)
    all_logits = scored_logits(together, 6)
    for seq, row in zip(together.seq_ids, all_logits):
        logits_of[seq] = row
    in_batch = StepSampler().launch(all_logits, together).choices()
    for one, choice in zip(batch, in_batch):
        alone = SamplingMetadata.from_works([one], "cpu", drafts_next=False)
        (single,) = StepSampler().launch(logits_of[one.seq_id][None], alone).choices()
        assert single == choice


def test_unseeded_requests_get_repeatable_engine_seeds():
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    prompts = [[11, 12, 13], [11, 12, 13], [40, 41]]
    runs = []
    for seed in (0, 0, 1):
        engine = LLMEngine("tiny-kimi-k3", seed=seed, **ENGINE_SETTINGS)
        try:
            runs.append([out["token_ids"] for out in engine.generate(prompts, params)])
        finally:
            engine.close()
    assert params.seed is None  # the caller's object is left as it was
    assert runs[0] == runs[1]  # Config.seed repeats the engine's choices
    assert runs[0] != runs[2]
    # Two requests for one prompt got different seeds.
    assert runs[0][0] != runs[0][1]


def test_the_engine_keeps_draft_distributions_only_for_sampled_requests():
    engine = spec_engine("tiny-kimi-k3", 2)
    try:
        step_sampler = engine.workers.runner.step_sampler
        engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8))
        sampled_id = engine.add_request(
            [9, 10, 11], SamplingParams(temperature=0.9, max_tokens=8, seed=4)
        )
        for _ in range(3):
            engine.step()
        sampled_seq_id = int(sampled_id)  # request ids default to the seq id
        assert list(step_sampler.draft_probs) == [sampled_seq_id]
        probs = step_sampler.draft_probs[sampled_seq_id]
        assert probs.shape == (2, engine.config.hf_config.text["vocab_size"])
        torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    finally:
        engine.close()


@pytest.mark.kernels
def test_the_greedy_verify_kernel_gives_the_torch_paths_tokens():
    """A greedy DSpark engine with the one-launch verify (a GPU's default, here
    through Triton's interpreter) emits the torch path's tokens and acceptance,
    while prompts arrive between verify steps and a sampled request joins."""
    if not triton_available("cpu"):
        pytest.skip("triton cannot run on the CPU here (no TRITON_INTERPRET=1)")
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=6, seed=5, ignore_eos=True)
    arrivals = [(0, [5, 6, 7, 8], greedy), (0, [9, 10], greedy)]
    arrivals += [(3, [11, 12, 13], greedy), (6, [14, 15], sampled)]
    runs = []
    for kernel in (False, True):
        engine = spec_engine("tiny-kimi-k3", 3)
        try:
            step_sampler = engine.workers.runner.step_sampler
            step_sampler.greedy_verify_kernel = kernel
            launches = 0
            launch = step_sampler._launch_greedy_verify

            def counted(*args, launch=launch):
                nonlocal launches
                launches += 1
                return launch(*args)

            step_sampler._launch_greedy_verify = counted
            pending, outputs, step = list(arrivals), {}, 0
            while pending or engine.has_unfinished_requests():
                while pending and pending[0][0] <= step:
                    _, prompt, params = pending.pop(0)
                    engine.add_request(prompt, params, request_id=str(len(pending)))
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out.output_token_ids
                step += 1
            runs.append((outputs, engine.scheduler.spec_stats.as_dict()))
        finally:
            engine.close()
        # The kernel took every all-greedy verify step, and only with it on.
        assert (launches > 5) if kernel else (launches == 0)
    assert runs[0] == runs[1]


def test_scored_rows_skip_the_gather_only_when_every_row_is_scored():
    hidden = torch.randn(9, 4)
    verify = [work(1, [8, 9], 10, drafts=1), work(2, [4, 11, 12], 20, drafts=2)]
    mixed = [work(0, [5, 6, 7], 0), work(3, [3], 5, sample=False), *verify]
    for works, everything in ((verify, True), (mixed, False)):
        sampling = SamplingMetadata.from_works(works, "cpu", drafts_next=True)
        rows = hidden[: sum(len(w.token_ids) for w in works)]
        assert sampling.scores_every_row is everything
        assert torch.equal(sampling.scored_rows(rows), rows[sampling.logit_rows])
        assert (sampling.scored_rows(rows) is rows) is everything
