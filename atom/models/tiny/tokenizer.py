"""A small, real, byte-level BPE tokenizer for the tiny test checkpoints.

The BPE is trained with the `tokenizers` library on the corpus embedded below, so it
is deterministic and needs no network. Byte-level pre-tokenization means every string
(ASCII or any UTF-8) encodes, and `decode(encode(s)) == s`.

Special tokens occupy the top `len(SPECIAL_TOKENS)` ids, in this order, so for a
vocabulary of V they sit at:

    V-8 <|bos|>    V-7 <|eos|>        V-6 <|im_system|>  V-5 <|im_user|>
    V-4 <|im_assistant|>  V-3 <|mask|>  V-2 <|im_end|>    V-1 <|pad|>

`<|mask|>` at V-3 and `<|pad|>` at V-1 mirror Kimi-K3 (163837 and 163839 of 163840).
Every id, `<|eos|>` included, lies inside the vocabulary the LM head scores, so a
greedy run stops when the model argmaxes eos like any other token.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
BYTE_ALPHABET_SIZE = 256

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "<|im_{{ message['role'] }}|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>{%- endif -%}"
)

# Varied prose, code, numbers and non-ASCII text, so the merges are not degenerate and
# there are enough distinct pairs to fill a vocabulary of 1024 and beyond.
_CORPUS = """
The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.
Inference engines schedule requests, allocate key-value cache blocks, and run the model
forward in batches. A pipeline splits the layers into stages; tensor parallelism splits
every matrix across ranks. Speculative decoding drafts several tokens and verifies them
with one target forward, accepting the longest prefix that matches.
Kimi Delta Attention keeps a recurrent state per head: it decays the state along the key
axis, writes the corrected value, and reads the output with the query. Multi-head latent
attention caches a compressed latent instead of full keys and values.
Once upon a time, in a small village by the sea, there lived an old fisherman who told
stories about storms, stars, lighthouses, whales, and ships that sailed beyond the map.
Children gathered every evening to listen, laughing and asking questions until midnight.
def greedy_decode(model, prompt, max_new_tokens=16):
    tokens = list(prompt)
    for step in range(max_new_tokens):
        logits = model(tokens)[-1]
        next_token = int(logits.argmax())
        if next_token == EOS_ID:
            break
        tokens.append(next_token)
    return tokens
for (i = 0; i < n; ++i) { sum += values[i] * weights[i]; } return sum / n;
SELECT name, count(*) FROM requests WHERE status = 'finished' GROUP BY name;
{"id": 42, "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop"}]}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 3.14159 2.71828 1e-5
Dates and times: 2026-08-14 09:30:00, Monday, Tuesday, Wednesday, Thursday, Friday.
Punctuation matters: commas, semicolons; colons: dashes - and -- quotes "double" 'single'
(parentheses) [brackets] {braces} <angles> slashes / \\ pipes | ampersands & at @ hash #
Café, naïve, façade, résumé, jalapeño, Grüße aus München, smörgåsbord, Ærø, Øresund.
Привет, мир! Как дела? Γειά σου κόσμε. שלום עולם. مرحبا بالعالم. नमस्ते दुनिया.
你好，世界！今天天气很好。日本語のテキストも少し含めます。한국어 문장도 있습니다.
Emoji and symbols: 🙂 🚀 ✨ ✓ → ← ≤ ≥ ± × ÷ € £ ¥ © ® ™ ° µ ∑ ∫ √ ∞ ≈ ≠.
Machine learning models learn patterns from data; larger models need more memory and
more compute, so engineers quantize weights, shard layers, and overlap communication.
The scheduler prefers decoding requests, then fills the remaining token budget with
chunks of waiting prompts. Prefix caching reuses blocks whose tokens hash identically.
Every morning the baker kneaded dough, shaped loaves, and watched them rise in the warm
kitchen; by noon the shelves were full of bread, rolls, pastries, pies, and cinnamon buns.
Mountains, rivers, forests, deserts, oceans, islands, valleys, glaciers, and volcanoes.
Red, orange, yellow, green, blue, indigo, violet, black, white, grey, silver, and gold.
"""


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


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE; exactly `vocab_size` ids including special tokens."""
    min_size = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if not isinstance(vocab_size, int) or vocab_size < min_size:
        raise ValueError(f"vocab_size must be an int >= {min_size}, got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    learned = tokenizer.get_vocab_size()
    if learned != vocab_size - len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size {vocab_size} is too large for the embedded corpus "
            f"(it yields at most {learned + len(SPECIAL_TOKENS)} ids)"
        )
    # Added after training so they land at the top of the id range, in order.
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    expected = special_token_ids(vocab_size)
    actual = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    if actual != expected or tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"special tokens landed at {actual}, expected {expected}")
    return tokenizer


def build_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
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
