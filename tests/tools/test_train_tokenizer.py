"""The shipped tokenizer is the one the training tool makes from the corpus."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from atom.models.tiny.configs import TINY_VOCAB_SIZE
from atom.models.tiny.tokenizer import SPECIAL_TOKENS, TOKENIZER_FILE, special_token_ids
from tools.corpus import load_excerpt
from tools.train_tokenizer import train_tokenizer


def test_vocabulary_sizes_are_checked():
    texts = [c.text for c in load_excerpt().train]
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, 100)
    with pytest.raises(ValueError, match="too large"):
        train_tokenizer(texts, 100_000)
    small = train_tokenizer(texts, 512)
    assert small.get_vocab_size() == 512
    assert {t: small.token_to_id(t) for t in SPECIAL_TOKENS} == special_token_ids(512)


def test_shipped_tokenizer_layout():
    tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))
    assert tokenizer.get_vocab_size() == TINY_VOCAB_SIZE
    assert {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS} == special_token_ids(
        TINY_VOCAB_SIZE
    )
    text = "Gr\u00fc\u00dfe \U0001f680 tabs\tand\nnewlines"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
