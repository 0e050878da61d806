"""Incremental detokenization: growing a short window per step gives exactly the
text of decoding everything at once, multi-byte characters and stop strings
included."""

import pytest

from atom.model_engine.output_processor import OutputProcessor
from atom.model_engine.sequence import Sequence, SequenceStatus
from atom.models.tiny import resolve_model_path
from atom.sampling_params import SamplingParams
from atom.utils.tokenizer import load_tokenizer, output_decoder

TEXT = "In the beginning — «héllo» 世界 👋 and the earth was without form."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("tiny-kimi-k3"))


def stream(tokenizer, ids: list[int], stop=None) -> list:
    """Feed `ids` one token per step; returns every step's RequestOutput."""
    seq = Sequence([1], SamplingParams(max_tokens=len(ids), stop=stop))
    processor = OutputProcessor(tokenizer)
    processor.add(seq)
    outputs = []
    for i, token in enumerate(ids):
        seq.token_ids.append(token)
        if i == len(ids) - 1:
            seq.status = SequenceStatus.FINISHED
        output, hit = processor.update(seq.request_id)
        outputs.append(output)
        if hit:
            break
    return outputs


def test_streamed_pieces_add_up_to_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    outputs = stream(tokenizer, ids)
    assert "".join(o.new_text for o in outputs) == TEXT
    assert outputs[-1].text == tokenizer.decode(ids, skip_special_tokens=True)
    # No step shows half a character.
    assert all("\ufffd" not in o.new_text for o in outputs)


def test_stop_string_cuts_the_text(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    outputs = stream(tokenizer, ids, stop=["earth"])
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert outputs[-1].text == TEXT[: TEXT.index("earth")]


@pytest.mark.parametrize("clean_up", [False, True])
def test_output_decoder_is_the_tokenizers_decode(clean_up):
    """The straight backend call (no clean-up) and the fallback (clean-up on) give
    exactly `tokenizer.decode(ids, skip_special_tokens=True)`, special ids and
    split characters included."""
    tokenizer = load_tokenizer(resolve_model_path("tiny-kimi-k3"))
    tokenizer.clean_up_tokenization_spaces = clean_up
    decode = output_decoder(tokenizer)
    ids = tokenizer.encode(TEXT + " , .", add_special_tokens=False)
    specials = tokenizer.all_special_ids
    for cut in range(len(ids) + 1):
        window = [*specials[:1], *ids[:cut], *specials[1:]]
        assert decode(window) == tokenizer.decode(window, skip_special_tokens=True)
