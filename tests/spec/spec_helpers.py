"""What the speculative-decoding tests share: engines, prompts, forced drafters."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from atom import LLMEngine
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.models.tiny.configs import TOKEN_IDS
from atom.spec_decode.draft_output import DraftOutput

# target -> its fitted tiny draft
PAIRS = {
    "tiny-kimi-k3": "tiny-kimi-k3-dspark",
    "tiny-kimi-k31": "tiny-kimi-k31-dspark",
}
BLOCK_SIZE = 16
ENGINE_SETTINGS = dict(device="cpu", max_model_len=256, block_size=BLOCK_SIZE)
# The tiny vocabularies end with bos / eos / pad / mask; prompts use plain tokens.
NUM_PLAIN_TOKENS = min(TOKEN_IDS.values())
EOS = TOKEN_IDS["eos_token_id"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models run per-sequence loops of small ops, which two OpenMP threads
    on a shared 2-core machine slow down many times over."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(NUM_PLAIN_TOKENS) for _ in range(count)]


def target_engine(target: str, **settings) -> LLMEngine:
    return LLMEngine(target, **{**ENGINE_SETTINGS, **settings})


def spec_engine(
    target: str, num_speculative_tokens: int, draft: str | None = None, **settings
) -> LLMEngine:
    return LLMEngine(
        target,
        method="dspark",
        draft_model=draft or PAIRS[target],
        num_speculative_tokens=num_speculative_tokens,
        **{**ENGINE_SETTINGS, **settings},
    )


def runner_of(engine: LLMEngine):
    """The in-process rank's ModelRunner (tp = pp = 1)."""
    return engine.workers.runner


def force_drafts(
    engine: LLMEngine, references: list[list[int]], num_right: int
) -> list[list[int]]:
    """Make the drafter right for exactly `num_right` drafts of every step.

    `references` holds each request's full greedy sequence (prompt + target-only
    continuation, at least T tokens past the last one generated). The real
    `propose` still runs; its drafts are replaced by the reference continuation for
    the first `num_right` positions and a different token after. Returns the list
    every forced block is appended to.
    """
    drafter = runner_of(engine).drafter
    original: Callable = drafter.propose
    vocab = drafter.model.vocab_size
    proposed: list[list[int]] = []

    def propose(anchor_ids, anchor_positions, block_tables, sampling):
        drafts = original(anchor_ids, anchor_positions, block_tables, sampling)
        forced = drafts.ids.clone()
        for row, (anchor, position) in enumerate(zip(anchor_ids, anchor_positions)):
            sequence = _reference_of(references, int(anchor), int(position))
            for k in range(forced.shape[1]):
                right = sequence[int(position) + 1 + k]
                forced[row, k] = right if k < num_right else (right + 1) % vocab
            proposed.append(forced[row].tolist())
        return DraftOutput(forced, drafts.probs)

    drafter.propose = propose
    return proposed


def _reference_of(references: list[list[int]], anchor: int, position: int):
    matches = [
        seq for seq in references if len(seq) > position and seq[position] == anchor
    ]
    if len(matches) != 1:
        raise AssertionError(
            f"anchor {anchor} at position {position} matches {len(matches)} "
            "reference sequences; use prompts that tell requests apart"
        )
    return matches[0]


def propose_on_host(
    drafter,
    anchors: list[int],
    positions: list[int],
    block_tables: list[list[int]],
    temperatures: list[float],
    top_ps: list[float] | float = 1.0,
    seeds: list[int] | None = None,
) -> DraftOutput:
    """`drafter.propose` from host lists (greedy rows need no seed)."""
    sampling = SamplingMetadata.build(temperatures, top_ps=top_ps, seeds=seeds)
    width = max(len(table) for table in block_tables)
    tables = [table + [0] * (width - len(table)) for table in block_tables]
    return drafter.propose(
        torch.tensor(anchors), torch.tensor(positions), torch.tensor(tables), sampling
    )
