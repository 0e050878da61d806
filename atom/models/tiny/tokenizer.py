"""The tiny checkpoints' tokenizer: a byte-level BPE shipped as package data.

`assets/tokenizer.json` was trained with the `tokenizers` library on the training
split of the tiny models' corpus (`python -m tools.train_tokenizer`), so building a
checkpoint copies it and needs no training. Byte-level pre-tokenization means every
string (ASCII or any UTF-8) encodes, and `decode(encode(s)) == s`.

Special tokens occupy the top `len(SPECIAL_TOKENS)` ids, in this order, so for a
vocabulary of V they sit at:

    V-8 <|bos|>    V-7 <|eos|>        V-6 <|im_system|>  V-5 <|im_user|>
    V-4 <|im_assistant|>  V-3 <|mask|>  V-2 <|im_end|>    V-1 <|pad|>

`<|mask|>` at V-3 and `<|pad|>` at V-1 mirror Kimi-K3 (163837 and 163839 of 163840).
Every id, `<|eos|>` included, lies inside the vocabulary the LM head scores, so a
greedy run stops when the model argmaxes eos like any other token.
"""

import json
import shutil
from pathlib import Path

TOKENIZER_FILE = Path(__file__).parent / "assets" / "tokenizer.json"

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|mask|>",
    "<|im_end|>",
    "<|pad|>",
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "<|im_{{ message['role'] }}|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>{%- endif -%}"
)


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Token string -> id of every special token for a vocabulary of `vocab_size`."""
    first = vocab_size - len(SPECIAL_TOKENS)
    return {token: first + i for i, token in enumerate(SPECIAL_TOKENS)}


def bos_eos_pad_mask_ids(vocab_size: int) -> dict[str, int]:
    """The ids configs need: bos, eos, pad and the DSpark mask token."""
    ids = special_token_ids(vocab_size)
    return {
        "bos_token_id": ids["<|bos|>"],
        "eos_token_id": ids["<|eos|>"],
        "pad_token_id": ids["<|pad|>"],
        "mask_token_id": ids["<|mask|>"],
    }


def build_tokenizer(out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TOKENIZER_FILE, out / "tokenizer.json")
    special_map = {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "mask_token": "<|mask|>",
        "additional_special_tokens": [
            "<|im_system|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_end|>",
        ],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", special_map)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
