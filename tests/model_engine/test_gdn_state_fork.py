"""KDA recurrent state across pipeline stages: prefix forks and speculative commits.

One pp2 engine with a DSpark draft runs the cases. KV alone cannot resume a KDA
layer, so a prefix hit must fork the state saved at the prefix's end; every stage
holds and forks only its own KDA layers. Under speculation every stage keeps the
state after each verify row and commits only the accepted prefix when the next
batch says so. Both are checked against cold pp1 runs without speculation, and
directly on the states every stage holds.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from atom.models.tiny.configs import k3_text_config
from atom.models.utils import get_pp_indices
from atom.sampling_params import SamplingParams
from tests.e2e.engine_helpers import NUM_PLAIN_TOKENS
from tests.e2e.pp_probe import (
    PAIRS,
    Recorder,
    generate_ids,
    kda_states,
    make_engine,
    teach_draft,
)

TARGET, DRAFT = PAIRS["k3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14)
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
_rng = random.Random(11)
PREFIX = [_rng.randrange(NUM_PLAIN_TOKENS) for _ in range(64)]  # four KV blocks
PROMPT_A = PREFIX + [_rng.randrange(NUM_PLAIN_TOKENS) for _ in range(10)]
PROMPT_B = PREFIX + [_rng.randrange(NUM_PLAIN_TOKENS) for _ in range(13)]
PROMPT_C = [_rng.randrange(NUM_PLAIN_TOKENS) for _ in range(21)]
KDA_LAYERS = [i - 1 for i in k3_text_config()["linear_attn_config"]["kda_layers"]]


def layer_index(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


def cold_state(prompt: list[int]) -> dict:
    """KDA states after a cold pp1 prefill of `prompt`, by layer name."""
    engine = make_engine(TARGET, enable_prefix_caching=False)
    recorder = Recorder(engine)
    generate_ids(engine, [prompt], FIRST_TOKEN)
    (states,) = engine.workers.call(kda_states(recorder.works_of(0)[0].state_slot))
    engine.close()
    return states


pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Cold pp1 outputs (no speculation, no prefix caching) and a pp2 engine."""
    prompts = [PROMPT_A, PROMPT_B, PROMPT_C]
    cold = make_engine(TARGET, enable_prefix_caching=False)
    cold_ids = generate_ids(cold, prompts, GREEDY)
    cold.close()
    chains = [p[-1:] + ids for p, ids in zip(prompts, cold_ids)]
    draft = teach_draft(DRAFT, chains, tmp_path_factory.mktemp("fork") / "draft")
    engine = make_engine(TARGET, draft, pipeline_parallel_size=2)
    yield engine, Recorder(engine), cold_ids
    engine.close()


def merged(per_rank: list[dict]) -> dict:
    return {name: state for states in per_rank for name, state in states.items()}


@pytest.mark.slow
def test_prefix_hit_forks_each_stage_own_layers_and_keeps_the_source(setup):
    engine, recorder, cold_ids = setup
    assert generate_ids(engine, [PROMPT_A], GREEDY) == [cold_ids[0]]
    saves = [w.state_save_dst for w in recorder.works_of(0) if w.state_save_dst]
    assert len(saves) == 1  # one checkpoint, at the prompt's last full block
    source = saves[0]
    before = engine.workers.call(kda_states(source))
    hits = engine.get_stats()["prefix_cache_hit_tokens"]

    assert generate_ids(engine, [PROMPT_B], GREEDY) == [cold_ids[1]]
    assert engine.get_stats()["prefix_cache_hit_tokens"] - hits == len(PREFIX)
    works = recorder.works_of(1)
    assert works[0].state_fork_src == source and works[0].context_len == len(PREFIX)
    assert all(w.state_fork_src is None for w in works[1:])  # consumed once

    after = engine.workers.call(kda_states(source))
    for stage, (old, new) in enumerate(zip(before, after)):
        start, end = get_pp_indices(8, stage, 2)
        # Each stage holds (and so forks) exactly its own KDA layers.
        assert sorted(layer_index(n) for n in new) == [
            i for i in KDA_LAYERS if start <= i < end
        ]
        for name in new:
            for o, n in zip(old[name], new[name]):
                assert np.any(o != 0)
                np.testing.assert_array_equal(o, n)  # the source is untouched
    # The saved state is the one a single stage reaches at the end of the prefix.
    reference = cold_state(PREFIX)
    for name, (conv, ssm) in merged(after).items():
        np.testing.assert_allclose(conv, reference[name][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(ssm, reference[name][1], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_verify_commits_only_the_accepted_rows_on_every_stage(setup):
    engine, recorder, cold_ids = setup
    engine.add_request(PROMPT_C, GREEDY)
    checked, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out.output_token_ids if out.finished else final
        batch, output = recorder.batches[-1], recorder.outputs[-1]
        verifies = any(work.num_drafts for work in batch.work)
        if not verifies or output.batch_id != batch.batch_id:
            continue
        (work,) = batch.work
        accepted = output.choices[0].num_accepted
        # Snapshot `accepted` is the state after rows [last, d1..d_accepted], the
        # one the next batch commits: the state after every token but the bonus.
        per_rank = engine.workers.call(kda_states(work.state_slot, accepted))
        partial = 0 < accepted < work.num_drafts
        checked.append((partial, work.context_len + 1 + accepted, per_rank))
    # The end-to-end proof: pp2 with drafts and rejections equals cold pp1.
    assert final == cold_ids[2]
    assert any(partial for partial, _, _ in checked)
    tokens = PROMPT_C + cold_ids[2]
    for _, num_committed, per_rank in checked:
        reference = cold_state(tokens[:num_committed])
        states = merged(per_rank)
        assert sorted(map(layer_index, states)) == KDA_LAYERS
        for name, (conv, ssm) in states.items():
            np.testing.assert_allclose(conv, reference[name][0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(ssm, reference[name][1], rtol=1e-4, atol=1e-5)
