"""Tokenizer loading for model folders, and the engine's choice of tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

# Any one of these makes a folder loadable by AutoTokenizer (fast, sentencepiece,
# BPE/WordPiece vocabularies, Kimi's tiktoken).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


TEXT_NEEDS_TOKENIZER = (
    "text prompts need a tokenizer, and this engine runs with --skip-tokenizer-init "
    "(skip_tokenizer_init=True): send the prompt as token ids"
)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The folder's tokenizer, without transformers' warning about model types it
    does not know (kimi_k3), which concerns its model classes, not the tokenizer."""
    # Imported here: transformers pulls in torch, and the server's modules import
    # this one while `atom --help` builds its flags.
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    finally:
        hf_logging.set_verbosity(verbosity)


def apply_chat_template(tokenizer, messages: list[dict]) -> str:
    """The prompt for `messages`: the tokenizer's chat template, or plain
    `role: content` lines when it has none."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def has_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def engine_tokenizer(model: str, tokenizer: str | None, skip_tokenizer_init: bool):
    """The tokenizer an engine encodes prompts and decodes outputs with: `tokenizer`
    if given, else the model folder's; None under `skip_tokenizer_init`, where the
    engine takes token-id prompts and returns token ids only."""
    if skip_tokenizer_init:
        if tokenizer is not None:
            raise ValueError(
                f"--tokenizer {tokenizer!r} and --skip-tokenizer-init exclude each "
                "other: drop one"
            )
        return None
    path = tokenizer or model
    if os.path.isdir(path) and not has_tokenizer_files(path):
        if tokenizer is not None:
            raise ValueError(
                f"--tokenizer {path!r} holds no tokenizer files (one of "
                f"{', '.join(TOKENIZER_FILES)})"
            )
        raise ValueError(
            f"model folder {path!r} has no tokenizer files (one of "
            f"{', '.join(TOKENIZER_FILES)}): pass --tokenizer PATH (LLMEngine: "
            "tokenizer=PATH) to load one from elsewhere, or --skip-tokenizer-init "
            "(skip_tokenizer_init=True) to take token-id prompts and return token ids"
        )
    return load_tokenizer(path)


# Pre-tokenizers that only split or re-map text, never drop any of it ("Split" and
# "Punctuation" do drop it with behavior "Removed", refused below).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Split", "Punctuation"})


def _pre_tokenizers(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The pre-tokenizers of a tokenizer.json, a Sequence flattened."""
    if spec is None:
        return []
    if spec["type"] == "Sequence":
        return [p for inner in spec["pretokenizers"] for p in _pre_tokenizers(inner)]
    return [spec]


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of prompt text one token can stand for, or None when
    this tokenizer gives no such bound.

    The bound holds for a byte-level BPE (a Hugging Face fast tokenizer whose
    pre-tokenizer includes ByteLevel and whose model is BPE) with no normalizer,
    no pre-tokenizer that drops text and no added token that swallows the spaces
    around it (lstrip / rstrip): there the tokens of a text spell out exactly its
    bytes, and no byte is ever an unknown token. Each vocabulary entry is written
    one character per byte (or is the added token's own text), so its UTF-8
    length is at least the bytes it stands for; the longest entry bounds them
    all. A text of B bytes is therefore at least ceil(B / bound) tokens.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow or custom tokenizer: nothing to inspect
    spec = json.loads(backend.to_str())
    pre_tokenizers = _pre_tokenizers(spec.get("pre_tokenizer"))
    if (
        spec.get("normalizer") is not None
        or spec["model"].get("type") != "BPE"
        or all(p["type"] != "ByteLevel" for p in pre_tokenizers)
        or any(
            p["type"] not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
            for p in pre_tokenizers
        )
        or any(t["lstrip"] or t["rstrip"] for t in spec.get("added_tokens", []))
    ):
        return None
    return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())


def output_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=True)`, the decode of
    output text, as cheap as it can be had.

    transformers' Python wrapper costs several times the Rust backend's decode of
    a short window, and the detokenizer decodes two windows per request per step.
    Where the wrapper adds nothing (a TokenizersBackend that overrides neither
    decode step and has no clean-up pass), the backend is called straight; any
    other tokenizer keeps its own decode.
    """
    # Imported here, as in load_tokenizer.
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    straight = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    if straight:
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
