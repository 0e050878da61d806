"""Sampled speculation is lossless: emitted tokens follow the target's own law.

One engine run per case sends 2000 seeded requests for the same prompt (T = 2,
max_tokens = 4): token 1 is sampled from the prefill, tokens 2 and 3 come out of
verify steps (an accepted draft, a residual draw after a rejection, or a bonus). For
every request and position k the exact target distribution p_k(. | prompt, t_<k) is
computed with the target model, and the rank of the emitted token under it is
binned (rank 0, 1, ..., B-2, and >= B-1). Pearson's chi-square compares the bin
counts with their expectations, sum over requests of p_k(bin); the chain rule makes
the positions together a test of the joint law. Expected counts summed over
requests with different p_k make the statistic conservative.

Threshold: the chi-square 0.999 quantile for B - 1 degrees of freedom. Seeds are
fixed, so the outcome is deterministic; a lossy verifier (for instance one that
emits the target argmax on rejection) moves mass into rank 0 by hundreds of counts.
"""

from __future__ import annotations

import pytest
import torch

from atom import SamplingParams
from atom.model_engine.batch import SeqWork
from atom.model_engine.cache_engine import CacheEngine
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_ops.sampler import probs_for
from atom.utils.forward_context import ForwardContext, set_forward_context
from tests.spec_decode.spec_helpers import (
    BLOCK_SIZE,
    spec_engine,
)
from tools.prefill import load_model

pytestmark = pytest.mark.usefixtures("single_thread_torch")

TARGET = "tiny-kimi-k3"
PROMPT = [17, 404, 911, 268, 5]
NUM_REQUESTS = 2000
T = 2
MAX_TOKENS = 4
POSITIONS = 3  # tokens 1..3; token 1 is plain sampling, a control
GROUP = 512  # prefixes per exact-distribution prefill
# The power check scores the samples against this temperature's law instead.
WRONG_TEMPERATURE = 0.25
# chi-square 0.999 quantiles by degrees of freedom.
CHI2_999 = {3: 16.266, 7: 24.322}


@pytest.fixture(scope="module")
def target():
    """The target alone, with caches for one prefill of many short sequences."""
    model, _ = load_model(TARGET)
    return model


@torch.inference_mode()
def exact_distributions(
    target, prefixes: list[tuple[int, ...]], params: SamplingParams
) -> dict[tuple[int, ...], torch.Tensor]:
    """{prefix: p(. | PROMPT + prefix)} from a prefill of each distinct prefix."""
    distinct = sorted(set(prefixes))
    blocks = -(-(len(PROMPT) + POSITIONS) // BLOCK_SIZE)
    result = {}
    for start in range(0, len(distinct), GROUP):
        group = distinct[start : start + GROUP]
        CacheEngine([target], blocks * len(group), BLOCK_SIZE, len(group), 0, "cpu",
                    torch.float32)  # fmt: skip
        works = [
            SeqWork(
                seq_id=i,
                token_ids=PROMPT + list(prefix),
                context_len=0,
                block_table=list(range(i * blocks, (i + 1) * blocks)),
                state_slot=i,
            )
            for i, prefix in enumerate(group)
        ]
        input_ids, positions, metadata = prepare_inputs(works, BLOCK_SIZE, "cpu")
        with set_forward_context(ForwardContext(metadata)):
            hidden = target(input_ids, positions)
        last = metadata.query_start_loc[1:] - 1
        logits = target.compute_logits(hidden[last])
        probs = probs_for(logits, params.temperature, params.top_k, params.top_p)
        result.update(zip(group, probs))
    return result


def rank_chi_square(
    samples: list[list[int]], exact: dict, position: int, num_bins: int
) -> tuple[float, list[float], list[int]]:
    """(statistic, expected counts, observed counts) of one position's rank bins."""
    expected = torch.zeros(num_bins, dtype=torch.float64)
    observed = torch.zeros(num_bins, dtype=torch.float64)
    # (bin probabilities, rank of each token) per distinct prefix: its samples share
    # one sort of the vocabulary (every sample shares the empty one).
    by_prefix: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    for tokens in samples:
        prefix = tuple(tokens[:position])
        if prefix not in by_prefix:
            p = exact[prefix].double()
            order = p.argsort(descending=True, stable=True)
            ranked = p[order]
            tail = ranked[num_bins - 1 :].sum().reshape(1)
            rank_of = torch.empty_like(order)
            rank_of[order] = torch.arange(len(order))
            by_prefix[prefix] = (torch.cat([ranked[: num_bins - 1], tail]), rank_of)
        bin_probs, rank_of = by_prefix[prefix]
        expected += bin_probs
        observed[min(int(rank_of[tokens[position]]), num_bins - 1)] += 1
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat, expected.tolist(), observed.int().tolist()


# Temperature scaling and top-k filtering, each on the verifier's accept, reject and
# bonus paths (plain temperature 1 is the first case's law without the scaling).
CASES = {
    "temperature-0.7": dict(temperature=0.7),
    "temperature-1.0-top-k-4": dict(temperature=1.0, top_k=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target_distribution(target, case):
    settings = CASES[case]
    num_bins = 4 if "top_k" in settings else 8
    engine = spec_engine(TARGET, T, max_num_seqs=256, max_num_batched_tokens=2048)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed, **settings)
        for seed in range(NUM_REQUESTS)
    ]
    samples = [
        out["token_ids"] for out in engine.generate([PROMPT] * NUM_REQUESTS, params)
    ]
    stats = engine.get_spec_decode_stats()
    prefixes = [tuple(s[:k]) for s in samples for k in range(POSITIONS)]
    engine.close()
    exact = exact_distributions(target, prefixes, params[0])
    wrong = exact_distributions(
        target,
        prefixes,
        SamplingParams(**{**settings, "temperature": WRONG_TEMPERATURE}),
    )

    print(f"{case}: {stats}")
    # Both the accept and the reject paths ran (with top-k 4 the draft's and the
    # target's top sets rarely agree twice in a row, so only the first draft).
    rho = stats["per_position_acceptance"]
    assert stats["distribution"][0] > 0.05 and rho[0] > 0.05
    if "top_k" not in settings:
        assert rho[1] > 0.01
    threshold = CHI2_999[num_bins - 1]
    for position in range(POSITIONS):
        stat, expected, observed = rank_chi_square(samples, exact, position, num_bins)
        # The same statistic tells a different law apart (power check).
        wrong_stat, _, _ = rank_chi_square(samples, wrong, position, num_bins)
        print(
            f"token {position + 1}: chi2 {stat:.2f} (against the wrong law "
            f"{wrong_stat:.1f}), observed {observed}, expected {expected}"
        )
        assert min(expected) >= 5, "too few expected counts for chi-square"
        assert stat < threshold, f"token {position + 1}: chi2 {stat:.1f}"
        assert wrong_stat > 2 * threshold
