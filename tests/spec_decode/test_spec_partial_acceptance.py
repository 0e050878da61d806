"""Partial acceptance rolls the KDA state back to exactly the committed tokens.

The drafter is made right for exactly j drafts per step (its real `propose` runs, then
the first j drafts are replaced by the target's greedy continuation and the rest by
other tokens), j in {0, 2, T}. After every commit, each KDA layer's conv and
recurrent state must equal a target-only run's state at the same committed length,
every verify step must accept exactly min(j, num_drafts) drafts, and the tokens must be the
target-only tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from atom import SamplingParams
from tests.spec_decode.spec_helpers import (
    PAIRS,
    force_drafts,
    random_tokens,
    runner_of,
    spec_engine,
    target_engine,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

T = 7
NEW_TOKENS = 30
SETTINGS = dict(max_num_seqs=1, max_num_batched_tokens=64)
# Verify rows and plain decode sum in different orders (fp32 drift ~1e-5 on states of
# size ~2); a state rolled back to a wrong row differs by O(0.1).
TOL = 1e-4


def kda_states(engine, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = runner_of(engine).cache.state_layers
    assert layers, "the tiny targets have KDA layers"
    return [(m.conv_state[slot].clone(), m.ssm_state[slot].clone()) for m in layers]


@pytest.fixture(scope="module", params=list(PAIRS))
def reference(request):
    """(target, prompt, greedy sequence, {committed length: KDA states}), target-only,
    one decode step at a time."""
    target = request.param
    prompt = random_tokens(random.Random(5), 21)
    engine = target_engine(target, **SETTINGS)
    # T tokens past the spec run's end, so forced drafts exist for every step.
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS + T, ignore_eos=True)
    engine.add_request(prompt, params)
    states, continuation = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                continuation = out.output_token_ids
        for seq in engine.scheduler.running:
            states[seq.num_computed_tokens] = kda_states(engine, seq.state_slot)
    engine.close()
    return target, prompt, prompt + continuation, states


def expected_acceptance(num_right: int) -> tuple[list[int], bool]:
    """(accepted drafts of each verify step, whether the last step verifies).

    The prefill emits token 1; a step verifies num_drafts = min(T, left - 1) drafts and
    accepts min(j, num_drafts); with one token left it decodes plainly.
    """
    left, accepted, last_is_verify = NEW_TOKENS - 1, [], False
    while left:
        num_verified = min(T, left - 1)
        last_is_verify = num_verified > 0
        if last_is_verify:
            accepted.append(min(num_right, num_verified))
        left -= 1 + (accepted[-1] if last_is_verify else 0)
    return accepted, last_is_verify


@pytest.mark.parametrize("num_right", [0, 2, T])
def test_state_and_tokens_after_partial_acceptance(reference, num_right):
    target, prompt, sequence, reference_states = reference
    engine = spec_engine(target, T, **SETTINGS)
    proposed = force_drafts(engine, [prompt], [sequence], num_right)
    cache = runner_of(engine).cache
    real_commit = cache.commit
    commits = []

    def commit(slots: list[int], num_rows: list[int]) -> None:
        real_commit(slots, num_rows)
        if not slots:
            return
        # Called while the next step runs: that step already counted its first row.
        committed = engine.scheduler.running[0].num_computed_tokens - 1
        (slot,), (rows,) = slots, num_rows  # one sequence
        commits.append((committed, rows, kda_states(engine, slot)))

    cache.commit = commit
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (out,) = engine.generate([prompt], params)
    stats = engine.get_spec_decode_stats()
    engine.close()

    assert out["token_ids"] == sequence[len(prompt) : len(prompt) + NEW_TOKENS]
    accepted, last_is_verify = expected_acceptance(num_right)
    assert stats["num_verify_steps"] == len(accepted)
    assert stats["total_accepted_tokens"] == sum(accepted)
    # Every verify is committed by the step after it (none follows the last one).
    committed_verifies = accepted[:-1] if last_is_verify else accepted
    assert [rows for _, rows, _ in commits] == [a + 1 for a in committed_verifies]
    assert len(proposed) >= len(accepted)
    for committed, _, states in commits:
        expected = reference_states[committed]
        for layer, ((conv, ssm), (ref_conv, ref_ssm)) in enumerate(
            zip(states, expected)
        ):
            where = f"KDA layer {layer} after {committed} committed tokens"
            torch.testing.assert_close(conv, ref_conv, atol=TOL, rtol=TOL, msg=where)
            torch.testing.assert_close(ssm, ref_ssm, atol=TOL, rtol=TOL, msg=where)
