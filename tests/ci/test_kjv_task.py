"""The CPU job's lm-eval task (scripts/ci/tasks/kjv_next_word.*): documents from
the shipped held-out verses, and the chance level its YAML states."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from atom.models.tiny.excerpt import held_out_verses

TASK_DIR = Path(__file__).resolve().parents[2] / "scripts" / "ci" / "tasks"


def load_task_module():
    spec = importlib.util.spec_from_file_location(
        "kjv_next_word", TASK_DIR / "kjv_next_word.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TaskLoader(yaml.SafeLoader):
    """lm-eval's `!function module.name` tag, kept as its text."""


TaskLoader.add_constructor(
    "!function", lambda loader, node: loader.construct_scalar(node)
)

task = load_task_module()
CONFIG = yaml.load((TASK_DIR / "kjv_next_word.yaml").read_text(), Loader=TaskLoader)
DOCS = task.next_word_docs(held_out_verses())


def test_documents_cut_held_out_verses_in_half():
    assert len(DOCS) == 288
    verses = [v for v in held_out_verses() if len(v.split()) >= task.MIN_VERSE_WORDS]
    first = verses[0].split()
    assert DOCS[0]["context"] == " ".join(first[: len(first) // 2])
    for doc in DOCS:
        assert doc["context"] and doc["target"].isalpha() and doc["target"].islower()


def test_the_stated_chance_level_is_the_majority_answer_share():
    assert CONFIG["metadata"]["chance_level"] == round(task.majority_baseline(DOCS), 4)
    with pytest.raises(ValueError):
        task.majority_baseline([])


def test_the_task_is_greedy_generation_scored_on_the_first_word():
    assert CONFIG["output_type"] == "generate_until"
    assert CONFIG["custom_dataset"] == "kjv_next_word.load_docs"
    generation = CONFIG["generation_kwargs"]
    assert generation["temperature"] == 0.0 and not generation["do_sample"]
    assert generation["max_gen_toks"] == 128
    (first_word,) = CONFIG["filter_list"]
    assert first_word["name"] == "first-word"
    assert CONFIG["num_fewshot"] == 0


def test_lm_eval_builds_the_task_from_the_repository():
    pytest.importorskip("lm_eval")
    from lm_eval.filters.extraction import RegexFilter
    from lm_eval.tasks import TaskManager

    loaded = TaskManager(include_path=str(TASK_DIR)).load(["kjv_next_word"])
    built = loaded["tasks"]["kjv_next_word"]
    docs = list(built.test_docs())
    assert docs == DOCS
    assert built.doc_to_text(docs[0]) == DOCS[0]["context"]
    regex = CONFIG["filter_list"][0]["filter"][0]["regex_pattern"]
    responses = [[" the LORD said"], [", and"], ["123"]]
    filtered = RegexFilter(regex_pattern=regex).apply(responses, docs[:3])
    assert [list(r) for r in filtered] == [["the"], ["and"], ["[invalid]"]]


def test_choice_documents_hold_the_next_word_among_four_answers():
    from scripts.ci.tasks.kjv_choice import NUM_CHOICES, choice_docs

    docs = choice_docs(DOCS)
    assert docs == choice_docs(DOCS)  # fixed seed: every run scores the same task
    assert len(docs) == len(DOCS)
    for doc, source in zip(docs, DOCS):
        assert doc["context"] == source["context"]
        assert len(set(doc["choices"])) == NUM_CHOICES
        assert doc["choices"][doc["label"]] == source["target"]
    # The answer's place is spread over the four slots: no position bias to exploit.
    slots = [sum(doc["label"] == i for doc in docs) for i in range(NUM_CHOICES)]
    assert min(slots) > len(docs) / NUM_CHOICES / 2
    choice_yaml = yaml.load(
        (TASK_DIR / "kjv_choice.yaml").read_text(), Loader=TaskLoader
    )
    assert choice_yaml["metadata"]["chance_level"] == 1 / NUM_CHOICES
