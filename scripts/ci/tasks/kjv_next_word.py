"""Documents of the `kjv_next_word` lm-eval task (kjv_next_word.yaml).

Every second held-out verse of the tiny models' corpus (atom/models/tiny/assets/
kjv_heldout.txt, chapters the models never trained on) with at least
MIN_VERSE_WORDS words is cut in half: the first half is the prompt, the first
word of the second half (its letters, lower-cased) is the answer. The model
continues greedily; the task's filter keeps the first run of letters of the
continuation. Taking every second verse (288 documents) keeps the CPU job within
a few minutes on two cores while the score stays many standard errors above chance.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from atom.models.tiny.excerpt import held_out_verses

MIN_VERSE_WORDS = 8
VERSE_STRIDE = 2
LETTERS = re.compile(r"[A-Za-z]+")


def next_word_docs(verses: list[str]) -> list[dict[str, str]]:
    """{"context", "target"} for every VERSE_STRIDE-th verse long enough to cut."""
    docs = []
    for verse in verses:
        words = verse.split()
        if len(words) < MIN_VERSE_WORDS:
            continue
        cut = len(words) // 2
        answer = LETTERS.search(" ".join(words[cut:]))
        if answer is None:
            continue
        docs.append({"context": " ".join(words[:cut]), "target": answer[0].lower()})
    return docs[::VERSE_STRIDE]


def majority_baseline(docs: list[dict[str, str]]) -> float:
    """Score of always answering the commonest answer: the task's chance level."""
    if not docs:
        raise ValueError("no documents")
    _, count = Counter(doc["target"] for doc in docs).most_common(1)[0]
    return count / len(docs)


def load_docs(**metadata: Any) -> dict[str, Any]:
    """lm-eval's `custom_dataset` hook: the test split, built from the shipped file.

    lm-eval passes the task's metadata as keyword arguments; none is needed.
    """
    import datasets  # lm-eval's own dependency, present wherever the task runs

    docs = next_word_docs(held_out_verses())
    return {"test": datasets.Dataset.from_list(docs, split=datasets.Split.TEST)}
