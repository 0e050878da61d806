"""What the speculative-decoding tests share: engines, prompts, forced drafters."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from atom import LLMEngine, SamplingParams
from atom.config import Config
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.models.tiny import resolve_model_path
from atom.models.tiny.configs import TOKEN_IDS
from atom.models.tiny.excerpt import held_out_prompts
from atom.models.tiny.tokenizer import TOKENIZER_FILE
from atom.spec_decode.draft_output import DraftOutput
from atom.spec_decode.dspark_drafter import DSparkDrafter

# target -> its distilled tiny draft
PAIRS = {
    "tiny-kimi-k3": "tiny-kimi-k3-dspark",
    "tiny-kimi-k31": "tiny-kimi-k31-dspark",
}
BLOCK_SIZE = 16
ENGINE_SETTINGS = dict(device="cpu", max_model_len=256, block_size=BLOCK_SIZE)
# The tiny vocabularies end with bos / eos / pad / mask; prompts use plain tokens.
NUM_PLAIN_TOKENS = min(TOKEN_IDS.values())
EOS = TOKEN_IDS["eos_token_id"]


def loaded_drafter(config: Config, target: torch.nn.Module) -> DSparkDrafter:
    """`config`'s DSpark drafter, its draft loaded and bound to `target`."""
    drafter = DSparkDrafter(config)
    drafter.load_model(target)
    return drafter


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(NUM_PLAIN_TOKENS) for _ in range(count)]


def _encode(text: str) -> list[int]:
    return Tokenizer.from_file(str(TOKENIZER_FILE)).encode(text).ids


def corpus_tokens(count: int, words: int = 12) -> list[list[int]]:
    """Held-out verse openings (distinct), tokenized: text the trained tiny targets
    continue and their drafts predict."""
    return [_encode(text) for text in held_out_prompts(count, words)]


def target_engine(target: str, **settings) -> LLMEngine:
    return LLMEngine(target, **{**ENGINE_SETTINGS, **settings})


def spec_engine(
    target: str, num_speculative_tokens: int, draft: str | None = None, **settings
) -> LLMEngine:
    return LLMEngine(
        target,
        method="dspark",
        draft_model=draft or PAIRS[target],
        num_speculative_tokens=num_speculative_tokens,
        **{**ENGINE_SETTINGS, **settings},
    )


def eos_target(
    target: str, prompt: list[int], first: int, out_dir: Path
) -> tuple[str, int]:
    """A copy of `target` whose greedy continuation of `prompt` ends with eos as
    token n >= `first`: (folder, n). Trained targets rarely argmax eos after a short
    prompt, so the LM head's eos row becomes the row of the token the target emits
    there, scaled by 1.001; n is the first position whose token is new to the
    continuation and not the last of a verify block (of T = 7 drafts), so eos lands
    inside one. The tests check on a target-only run that eos does come at n."""
    engine = target_engine(target, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=first + 16, ignore_eos=True)
    (out,) = engine.generate([prompt], params)
    engine.close()
    ids = out["token_ids"]
    # Token 1 comes from the prefill, then blocks of T + 1 = 8.
    candidates = [
        n
        for n in range(first, len(ids) + 1)
        if ids[n - 1] not in ids[: n - 1] and (n - 1) % 8
    ]
    if not candidates:
        raise AssertionError(f"{target} repeats itself after {prompt}: no new token")
    n = candidates[0]
    source = Path(resolve_model_path(target))
    shutil.copytree(source, out_dir)
    index = out_dir / "model.safetensors.index.json"
    head = "language_model.lm_head.weight"
    shard = json.loads(index.read_text())["weight_map"][head]
    tensors = load_file(out_dir / shard)
    weight = tensors[head].clone()
    weight[EOS] = 1.001 * weight[ids[n - 1]]
    tensors[head] = weight
    save_file(tensors, str(out_dir / shard), metadata={"format": "pt"})
    return str(out_dir), n


def runner_of(engine: LLMEngine):
    """The in-process rank's ModelRunner (tp = pp = 1)."""
    return engine.workers.runner


def force_drafts(
    engine: LLMEngine,
    prompts: list[list[int]],
    references: list[list[int]],
    num_right: int,
) -> list[list[int]]:
    """Make the drafter right for exactly `num_right` drafts of every step.

    `references` holds each request's full greedy sequence (its prompt + target-only
    continuation, at least T tokens past the last one generated). The real
    `propose` still runs; its drafts are replaced by the reference continuation for
    the first `num_right` positions and a different token after. Returns the list
    every forced block is appended to.
    """
    drafter = runner_of(engine).drafter
    original: Callable = drafter.propose
    vocab = drafter.model.vocab_size
    proposed: list[list[int]] = []
    # A request's first KV block -> its reference. Trained targets fall into the
    # same phrases, so (anchor, position) alone can match several requests; it is
    # unambiguous at a request's first proposal, which sits right after its prompt.
    owners: dict[int, list[int]] = {}

    def reference_of(anchor: int, position: int, first_block: int) -> list[int]:
        owner = owners.get(first_block)
        if owner is not None and len(owner) > position and owner[position] == anchor:
            return owner
        starts = [
            ref
            for prompt, ref in zip(prompts, references, strict=True)
            if len(prompt) == position and ref[position] == anchor
        ]
        if len(starts) != 1:
            raise AssertionError(
                f"anchor {anchor} at position {position} starts {len(starts)} "
                "reference sequences; use prompts that tell requests apart"
            )
        owners[first_block] = starts[0]
        return starts[0]

    def propose(anchor_ids, anchor_positions, block_tables, sampling):
        drafts = original(anchor_ids, anchor_positions, block_tables, sampling)
        forced = drafts.ids.clone()
        rows = zip(anchor_ids, anchor_positions, block_tables)
        for row, (anchor, position, table) in enumerate(rows):
            sequence = reference_of(int(anchor), int(position), int(table[0]))
            # Drafts past the reference's end stay the drafter's own: they follow
            # a request's last verify (which verifies past max_tokens) and are
            # never emitted.
            width = min(forced.shape[1], len(sequence) - int(position) - 1)
            for k in range(width):
                right = sequence[int(position) + 1 + k]
                forced[row, k] = right if k < num_right else (right + 1) % vocab
            proposed.append(forced[row].tolist())
        return DraftOutput(forced, drafts.probs)

    drafter.propose = propose
    return proposed


def propose_on_host(
    drafter,
    anchors: list[int],
    positions: list[int],
    block_tables: list[list[int]],
    temperatures: list[float],
    top_ps: list[float] | float = 1.0,
    seeds: list[int] | None = None,
) -> DraftOutput:
    """`drafter.propose` from host lists (greedy rows need no seed)."""
    sampling = SamplingMetadata.build(temperatures, top_ps=top_ps, seeds=seeds)
    width = max(len(table) for table in block_tables)
    tables = [table + [0] * (width - len(table)) for table in block_tables]
    return drafter.propose(
        torch.tensor(anchors), torch.tensor(positions), torch.tensor(tables), sampling
    )
