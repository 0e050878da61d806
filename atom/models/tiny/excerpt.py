"""The held-out excerpt of the tiny models' corpus, shipped for prompts and evaluation.

`assets/kjv_heldout.txt` holds the King James Bible chapters that the tiny models
never trained on (public domain; `tools.corpus` writes it), one verse a line and a
blank line between chapters. Prompts cut from it show what the models learned
rather than what they memorised.
"""

from pathlib import Path

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
