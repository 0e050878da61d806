"""Documents of the `kjv_choice` lm-eval task (kjv_choice.yaml): a loglikelihood task.

The documents of `kjv_next_word` (the same halves of held-out verses) become
four-way multiple choice: the verse's next word and three other answers of the task,
drawn with a fixed seed, in a shuffled order. lm-eval scores each choice by the
log-probability the model gives it after the context (prompt logprobs through
`echo`), so this runs the engine's scoring path where kjv_next_word runs generation.
"""

from __future__ import annotations

import random
from typing import Any

from atom.models.tiny.excerpt import held_out_verses
from scripts.ci.tasks.kjv_next_word import (
    next_word_docs,
)  # the repository root is on the path

NUM_CHOICES = 4
SEED = 0


def choice_docs(docs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """{"context", "choices", "label"} per next-word document, deterministic."""
    answers = sorted({doc["target"] for doc in docs})
    rng = random.Random(SEED)
    out = []
    for doc in docs:
        others = rng.sample([a for a in answers if a != doc["target"]], NUM_CHOICES - 1)
        choices = [doc["target"], *others]
        rng.shuffle(choices)
        out.append(
            {
                "context": doc["context"],
                "choices": choices,
                "label": choices.index(doc["target"]),
            }
        )
    return out


def load_docs(**metadata: Any) -> dict[str, Any]:
    """lm-eval's `custom_dataset` hook: the test split, built from the shipped file."""
    import datasets  # lm-eval's own dependency, present wherever the task runs

    docs = choice_docs(next_word_docs(held_out_verses()))
    return {"test": datasets.Dataset.from_list(docs, split=datasets.Split.TEST)}
