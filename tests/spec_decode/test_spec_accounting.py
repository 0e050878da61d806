"""Speculation counters, the `[MTP Stats` line, and how the drafts load.

With a drafter forced right for exactly 3 of T = 7 drafts, every count is known in
advance, including the last step of each request where fewer than T are verified; a
natural run must satisfy tok/fwd = 1 + accepted/steps and rate = accepted/drafted.
"""

from __future__ import annotations

import random
import re

import pytest
from safetensors.torch import load_file

from atom import SamplingParams
from atom.models.tiny import resolve_model_path
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
RIGHT = 3
STEPS_PER_REQUEST = 5
# Prefill emits 1 token, then every verify RIGHT + 1: 5 verify steps exactly.
MAX_TOKENS = 1 + (RIGHT + 1) * STEPS_PER_REQUEST
STATS_LINE = re.compile(
    r"^\[MTP Stats {9}\] Average toks/fwd: (\d+\.\d\d), "
    r"Accepted/Total Draft tokens: (\d+)/(\d+), "
    r"Acceptance rate: (\d+\.\d\d)%, "
    r"Accepted tokens distribution: \{(.*)\}$"
)


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(3)
    return [random_tokens(rng, 6 + 5 * i) for i in range(count)]


def test_forced_counts_follow_the_general_formulas():
    target = "tiny-kimi-k3"
    prompts = _prompts(3)
    # Reference sequences long enough for every forced block (T past the end).
    reference = target_engine(target, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS + T, ignore_eos=True)
    sequences = [
        p + out["token_ids"]
        for p, out in zip(prompts, reference.generate(prompts, params))
    ]
    reference.close()
    engine = spec_engine(target, T, max_num_seqs=4)
    force_drafts(engine, prompts, sequences, RIGHT)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    stats = engine.get_spec_decode_stats()
    assert engine.get_mtp_statistics() == stats  # ATOM's name
    line = engine.format_mtp_stats_line()
    engine.close()

    for prompt, out, sequence in zip(prompts, outputs, sequences):
        assert out["token_ids"] == sequence[len(prompt) : len(prompt) + MAX_TOKENS]
    steps = len(prompts) * STEPS_PER_REQUEST
    # num_drafts = min(T, remaining - 1): T until the last step, which has 4 tokens left.
    drafted = len(prompts) * (T * (STEPS_PER_REQUEST - 1) + RIGHT)
    accepted = steps * RIGHT
    assert stats["num_verify_steps"] == steps
    assert stats["total_draft_tokens"] == drafted
    assert stats["total_accepted_tokens"] == accepted
    assert stats["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert stats["avg_tokens_per_forward"] == pytest.approx(1 + RIGHT)
    assert stats["per_position_acceptance"] == [1.0] * RIGHT + [0.0] * (T - RIGHT)
    assert stats["distribution"][RIGHT] == 1.0
    # The line CI parses carries the same numbers.
    match = STATS_LINE.match(line)
    assert match, line
    assert float(match[1]) == pytest.approx(1 + RIGHT)
    assert (int(match[2]), int(match[3])) == (accepted, drafted)
    assert float(match[4]) == pytest.approx(100 * accepted / drafted, abs=0.005)
    shares = dict(re.findall(r"(\d+): '(\d+\.\d\d)%'", match[5]))
    assert shares == {str(a): "100.00" if a == RIGHT else "0.00" for a in range(T + 1)}


def test_natural_run_satisfies_the_identities():
    engine = spec_engine("tiny-kimi-k31", T, max_num_seqs=8)
    prompts = _prompts(6)
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    stats = engine.get_spec_decode_stats()
    line = engine.format_mtp_stats_line()
    engine.close()

    steps, accepted = stats["num_verify_steps"], stats["total_accepted_tokens"]
    drafted = stats["total_draft_tokens"]
    assert steps > 0 and drafted > 0
    assert stats["avg_tokens_per_forward"] == pytest.approx(1 + accepted / steps)
    assert stats["acceptance_rate"] == pytest.approx(accepted / drafted)
    rho = stats["per_position_acceptance"]
    assert all(a >= b for a, b in zip(rho, rho[1:]))
    assert sum(rho) == pytest.approx(stats["avg_tokens_per_forward"] - 1)
    assert sum(stats["distribution"].values()) == pytest.approx(1.0)
    # Every output token came from a prefill, a verify step (a + 1 each), or a
    # plain decode step once a single token was left (num_drafts = 0); no EOS here.
    emitted = sum(len(out["token_ids"]) for out in outputs)
    plain_steps = emitted - len(prompts) - steps - accepted
    assert 0 <= plain_steps <= len(prompts)
    assert STATS_LINE.match(line), line


@pytest.mark.parametrize("target", list(PAIRS))
def test_draft_binds_the_target_tables_and_loads_every_weight(target):
    engine = spec_engine(target, T, max_num_seqs=1)
    runner = runner_of(engine)
    draft, report = runner.drafter.model, runner.drafter.load_report
    language_model = runner.model.language_model
    assert draft.embed_tokens is language_model.model.embed_tokens
    assert draft.lm_head is language_model.lm_head
    own = dict(draft.named_parameters())
    assert report.loaded == set(own)
    skipped = set(report.skipped_declared)
    shipped = load_file(f"{resolve_model_path(PAIRS[target])}/model.safetensors")
    has_copy = "embed_tokens.weight" in shipped
    assert has_copy == (target == "tiny-kimi-k3")  # K3.1 drafts ship no embedding
    assert skipped == {n for n in shipped if n.startswith("confidence_head.")} | (
        {"embed_tokens.weight"} if has_copy else set()
    )
    # The loaded values are the shipped (fitted) ones.
    for name, param in own.items():
        if ".gate_up_proj." in name:
            gate = shipped[name.replace("gate_up_proj", "gate_proj")]
            up = shipped[name.replace("gate_up_proj", "up_proj")]
            assert param[: gate.shape[0]].equal(gate) and param[gate.shape[0] :].equal(
                up
            )
        else:
            assert param.equal(shipped[name]), name
    engine.close()
