"""max_bytes_per_token: a bound that holds on the tokenizer it is given, and none
for tokenizers whose tokens may stand for more text than they spell."""

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from atom.models.tiny import resolve_model_path
from atom.utils.tokenizer import load_tokenizer, max_bytes_per_token


def fewest_tokens(text: str, bound: int) -> int:
    return -(-len(text.encode("utf-8")) // bound)


def byte_level_bpe() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


def wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_the_bound_holds_for_the_tiny_tokenizer():
    tokenizer = load_tokenizer(str(resolve_model_path("tiny-kimi-k3")))
    bound = max_bytes_per_token(tokenizer)
    assert bound is not None and bound > 1
    longest = max(tokenizer.get_vocab(), key=lambda t: len(t.encode("utf-8")))
    texts = [
        "the quick brown fox " * 200,
        " " * 5000,
        "é漢字🙂" * 500,
        "<|bos|><|eos|>" * 300,  # special tokens: many bytes each, one token
        tokenizer.convert_tokens_to_string([longest]) * 300,
    ]
    for text in texts:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert len(tokens) >= fewest_tokens(text, bound), text[:40]


def test_a_plain_byte_level_bpe_gets_a_bound():
    assert max_bytes_per_token(wrap(byte_level_bpe())) == 2  # 'Ġ' is 2 UTF-8 bytes


def test_no_bound_without_a_tokenizer():
    assert max_bytes_per_token(None) is None


@pytest.mark.parametrize("change", ["normalizer", "whitespace", "lstrip", "wordlevel"])
def test_no_bound_where_tokens_may_stand_for_more_text(change):
    # Each change lets a token stand for text it does not spell: NFKC composes
    # characters, Whitespace drops spaces, an lstrip token swallows those before
    # it, and a word-level model maps every unknown word to one [UNK].
    tokenizer = byte_level_bpe()
    if change == "normalizer":
        tokenizer.normalizer = normalizers.NFKC()
    elif change == "whitespace":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel()]
        )
    elif change == "lstrip":
        tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    else:
        tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_bytes_per_token(wrap(tokenizer)) is None
