"""Train the tiny models' byte-level BPE on the corpus's training split.

    python -m tools.train_tokenizer [--deb bible-kjv-text_4.38_all.deb]

writes `atom/models/tiny/assets/tokenizer.json`: `TINY_VOCAB_SIZE` ids, the BPE
merges first and the special tokens on top (see `atom.models.tiny.tokenizer`).
"""

from __future__ import annotations

import argparse

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from atom.models.tiny.configs import TINY_VOCAB_SIZE
from atom.models.tiny.tokenizer import (
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    special_token_ids,
)
from tools.corpus import load_corpus

BYTE_ALPHABET_SIZE = 256
# Merges seen once are noise in a corpus of this size.
MIN_PAIR_FREQUENCY = 2


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE over `texts`: exactly `vocab_size` ids, specials on top."""
    min_size = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if not isinstance(vocab_size, int) or vocab_size < min_size:
        raise ValueError(f"vocab_size must be an int >= {min_size}, got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=MIN_PAIR_FREQUENCY,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    learned = tokenizer.get_vocab_size()
    if learned != vocab_size - len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size {vocab_size} is too large for these texts "
            f"(they yield at most {learned + len(SPECIAL_TOKENS)} ids)"
        )
    # Added after training so they land at the top of the id range, in order.
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    expected = special_token_ids(vocab_size)
    actual = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    if actual != expected or tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"special tokens landed at {actual}, expected {expected}")
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deb", help="a bible-kjv-text .deb (default: apt-get)")
    args = parser.parse_args(argv)
    corpus = load_corpus(args.deb)
    tokenizer = train_tokenizer([c.text for c in corpus.train], TINY_VOCAB_SIZE)
    tokenizer.save(str(TOKENIZER_FILE))
    print(f"wrote {TOKENIZER_FILE} ({tokenizer.get_vocab_size()} ids)")


if __name__ == "__main__":
    main()
