"""The held-out excerpt of the tiny models' corpus, shipped for prompts and evaluation.

`assets/kjv_heldout.txt` holds the King James Bible chapters that the tiny models
never trained on (public domain; `tools.corpus` writes it), one verse a line and a
blank line between chapters. Prompts cut from it show what the models learned
rather than what they memorised.
"""

from pathlib import Path

from tokenizers import Tokenizer

from atom.models.tiny.tokenizer import TOKENIZER_FILE

HELD_OUT_FILE = Path(__file__).parent / "assets" / "kjv_heldout.txt"


def held_out_verses() -> list[str]:
    """Every held-out verse, in order."""
    text = HELD_OUT_FILE.read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def held_out_prompts(count: int, words: int = 12) -> list[str]:
    """`count` prompts: the first `words` words of verses spread evenly over the
    excerpt (deterministic)."""
    verses = held_out_verses()
    if not 1 <= count <= len(verses) or words < 1:
        raise ValueError(
            f"count must be in [1, {len(verses)}] and words >= 1, got {count}, {words}"
        )
    stride = len(verses) // count
    return [" ".join(verses[i * stride].split()[:words]) for i in range(count)]


def held_out_prompt_ids(count: int, length: int) -> list[list[int]]:
    """`held_out_prompts(count, words=length)` in the tiny tokenizer's ids, cut to
    `length` tokens each, without special tokens: the prompts the accuracy tools and
    the fp8 acceptance test give the trained tiny models."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))
    return [
        tokenizer.encode(text, add_special_tokens=False).ids[:length]
        for text in held_out_prompts(count, words=length)
    ]
