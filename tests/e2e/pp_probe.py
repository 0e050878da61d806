"""Probes for the PP DSpark end-to-end tests: engines, recorders, rank inspection.

Rank inspection functions run inside every rank through `engine.workers.call`, so
they live at module level (they must pickle) and return numpy or plain data.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from atom.model_engine.batch import BatchOutput, ScheduledBatch
from atom.model_engine.llm_engine import LLMEngine
from atom.models.interfaces import RecurrentStateLayer
from atom.models.tiny import resolve_model_path
from atom.models.tiny.excerpt import held_out_verses
from atom.models.tiny.tokenizer import TOKENIZER_FILE
from atom.models.utils import PPMissingLayer, language_model_of, pp_holds_embedding
from atom.sampling_params import SamplingParams

BLOCK_SIZE = 16
T = 7
# Small chunks, so prompts span several prefill chunks and several KV blocks.
SETTINGS = dict(
    device="cpu",
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    block_size=BLOCK_SIZE,
    enable_prefix_caching=True,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PAIRS = {"k3": ("tiny-kimi-k3", "tiny-kimi-k3-dspark"),
         "k31": ("tiny-kimi-k31", "tiny-kimi-k31-dspark")}  # fmt: skip


def corpus_prompts(lengths=(9, 26, 45, 70)) -> list[list[int]]:
    """Windows of the tokenized held-out excerpt, one per length, spread over it:
    text the trained tiny models can continue (and their drafts predict)."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER_FILE))
    stream = tokenizer.encode(" ".join(held_out_verses())).ids
    stride = (len(stream) - max(lengths)) // len(lengths)
    return [stream[i * stride : i * stride + n] for i, n in enumerate(lengths)]


def make_engine(target: str, draft: str | None = None, **kwargs) -> LLMEngine:
    spec = {}
    if draft is not None:
        spec = dict(method="dspark", draft_model=draft, num_speculative_tokens=T)
    return LLMEngine(target, **{**SETTINGS, **spec, **kwargs})


class Recorder:
    """Keeps every batch the head submits and every output it receives."""

    def __init__(self, engine: LLMEngine) -> None:
        self.batches: list[ScheduledBatch] = []
        self.outputs: list[BatchOutput] = []
        workers = engine.workers
        submit, receive = workers.submit, workers.receive_output

        def recording_submit(batch: ScheduledBatch) -> None:
            self.batches.append(batch)
            submit(batch)

        def recording_receive() -> BatchOutput:
            output = receive()
            self.outputs.append(output)
            return output

        workers.submit = recording_submit
        workers.receive_output = recording_receive

    def drafts_by_sequence(self) -> list[list[list[int]]]:
        """Every draft each sequence received, sequences in admission order."""
        drafts: dict[int, list[list[int]]] = {}
        for output in self.outputs:
            for choice in output.choices:
                drafts.setdefault(choice.seq_id, []).append(choice.draft_token_ids)
        return [drafts[s] for s in sorted(drafts)]

    def works_of(self, index: int) -> list:
        """SeqWorks of the index-th sequence (admission order), batch order."""
        seq_ids = sorted({w.seq_id for b in self.batches for w in b.work})
        return [w for b in self.batches for w in b.work if w.seq_id == seq_ids[index]]

    def slots(self, index: int, num_tokens: int) -> list[int]:
        """Paged-KV slots of positions 0..num_tokens-1 of the index-th sequence."""
        table = max((w.block_table for w in self.works_of(index)), key=len)
        return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(num_tokens)]  # fmt: skip


def teach_draft(
    draft: str, chains: list[list[int]], out_dir: Path, skip_every: int = 3
) -> str:
    """A copy of `draft` whose Markov head predicts most transitions of `chains`.

    W1[p] = 1000 * W2[n] for a transition p -> n dominates the base logits, while
    every `skip_every`-th transition is left out: those drafts come from the base
    logits (so from the relayed taps), which makes partially accepted blocks certain
    on any prompts, trained draft or not. W2 has random unit rows for the taught next
    tokens only (zeros elsewhere), so in a low Markov rank the taught tokens still
    stand apart. Everything but the two Markov tables is the original checkpoint.
    """
    source = Path(resolve_model_path(draft))
    out_dir = Path(out_dir)
    shutil.copytree(source, out_dir)
    tensors = load_file(source / "model.safetensors")
    w1 = tensors["markov_head.markov_w1.weight"].clone()
    vocab, rank = w1.shape
    taught: dict[int, int] = {}
    for chain in chains:
        for i, (prev, nxt) in enumerate(zip(chain, chain[1:])):
            if i % skip_every != skip_every - 1 and prev not in taught:
                taught[prev] = nxt
    gen = torch.Generator().manual_seed(0)
    w2 = torch.zeros(vocab, rank)
    targets = sorted(set(taught.values()))
    w2[targets] = F.normalize(torch.randn(len(targets), rank, generator=gen), dim=-1)
    for prev, nxt in taught.items():
        bias = w2 @ w2[nxt]
        runner_up = bias.topk(2).values[1]
        if bias.argmax() == nxt and bias[nxt] - runner_up > 0.1:
            w1[prev] = 1000.0 * w2[nxt]
    tensors["markov_head.markov_w1.weight"] = w1.contiguous()
    tensors["markov_head.markov_w2.weight"] = w2.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return str(out_dir)


def generate_ids(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    return [r["token_ids"] for r in engine.generate(prompts, params)]


def acceptance(engine: LLMEngine) -> float:
    return engine.get_spec_decode_stats()["acceptance_rate"]


# ---- run inside every rank (engine.workers.call) ----


def _draft_context_rows(runner, slots: list[int]) -> list[np.ndarray] | None:
    if runner.drafter is None:
        return None
    index = torch.tensor(slots)
    rows = []
    for layer in runner.drafter.model.layers:
        cache = layer.self_attn.kv_cache
        rows.append(cache.reshape(-1, cache.shape[-1])[index].numpy().copy())
    return rows


def draft_context_rows(slots: list[int]):
    return functools.partial(_draft_context_rows, slots=slots)


def _kda_states(runner, slot: int, snapshot_row: int | None):
    """{layer name: (conv, ssm)} of this stage's KDA layers at `slot` (or the
    verify snapshot after row `snapshot_row`)."""
    states = {}
    for name, module in runner.model.named_modules():
        if not isinstance(module, RecurrentStateLayer):
            continue
        if snapshot_row is None:
            conv, ssm = module.conv_state[slot], module.ssm_state[slot]
        else:
            conv = module.conv_snapshots[slot, snapshot_row]
            ssm = module.ssm_snapshots[slot, snapshot_row]
        states[name] = (conv.numpy().copy(), ssm.numpy().copy())
    return states


def kda_states(slot: int, snapshot_row: int | None = None):
    return functools.partial(_kda_states, slot=slot, snapshot_row=snapshot_row)


def embedding_facts(runner) -> dict:
    """Where this rank's embedding tables are and what the draft bound."""
    lm = language_model_of(runner.model)
    facts = {
        "pp_holds_embedding": pp_holds_embedding(runner.config),
        "target_embedding_real": not isinstance(lm.model.embed_tokens, PPMissingLayer),
        "has_drafter": runner.drafter is not None,
    }
    if runner.drafter is not None:
        draft = runner.drafter.model
        facts["draft_embedding_is_none"] = draft.embed_tokens is None
        facts["draft_shares_target_table"] = draft.embed_tokens is lm.model.embed_tokens
    return facts
