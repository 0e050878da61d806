"""Tokenizer loading for model folders."""

from __future__ import annotations

from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The folder's tokenizer, without transformers' warning about model types it
    does not know (kimi_k3), which concerns its model classes, not the tokenizer."""
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
