"""What the end-to-end engine tests share: engine settings, prompts, golden oracle."""

from __future__ import annotations

import random

from atom.models.tiny import resolve_model_path
from atom.models.tiny.configs import TOKEN_IDS
from tests.reference.k3_golden import GoldenModel

# Small chunks and blocks, so prompts split across chunks and span several blocks.
BLOCK_SIZE = 16
ENGINE_SETTINGS = dict(
    device="cpu",
    max_model_len=256,
    max_num_seqs=8,  # fewer than a batch: requests wait and reuse state slots
    max_num_batched_tokens=32,
    block_size=BLOCK_SIZE,
)
# The tiny vocabularies end with bos / eos / pad / mask; prompts use plain tokens.
NUM_PLAIN_TOKENS = min(TOKEN_IDS.values())


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(NUM_PLAIN_TOKENS) for _ in range(count)]


class GoldenOracle:
    """`GoldenModel.golden_greedy` continuations, memoized per (model, prompt, n)."""

    def __init__(self) -> None:
        self._models: dict[str, GoldenModel] = {}
        self._memo: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def model(self, name: str) -> GoldenModel:
        if name not in self._models:
            self._models[name] = GoldenModel.from_pretrained(resolve_model_path(name))
        return self._models[name]

    def continuation(self, name: str, prompt: list[int], n: int) -> list[int]:
        key = (name, tuple(prompt), n)
        if key not in self._memo:
            self._memo[key] = self.model(name).golden_greedy(prompt, n)
        return self._memo[key]
