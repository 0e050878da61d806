"""What the target-model tests (Kimi, MiniMax-M3) share: build, load, bind caches,
run rows, transformers oracles, PP embedding placements."""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import nn

from atom.config import Config
from atom.model_engine.batch import SeqWork
from atom.model_engine.cache_engine import CacheEngine
from atom.model_engine.cuda_graph import PrefillShape
from atom.model_engine.model_inputs import SeqPadding, prepare_inputs
from atom.model_loader.loader import load_weights
from atom.models.registry import get_model_class
from atom.models.tiny.configs import k3_text_config, kimi_linear_config
from atom.models.utils import IntermediateTensors
from atom.utils.forward_context import (
    AttentionMetadata,
    ForwardContext,
    set_forward_context,
)

BLOCK_SIZE = 4
# Where a target builds `embed_tokens` under PP: (pp_rank, pp_size, method, kv_role,
# whether the table is real). The last stage holds it only for an embedding-sharing
# drafter, never on a context-only producer or a middle stage.
EMBEDDING_PLACEMENTS = [
    (1, 2, "dspark", "none", True),  # last stage feeding the DSpark drafter
    (1, 2, None, "none", False),  # last stage, no speculation
    (1, 2, "dspark", "kv_producer", False),  # a producer proposes nothing
    (1, 3, "dspark", "none", False),  # middle stage
    (0, 2, None, "none", True),  # first stage
    (0, 2, "dspark", "none", True),  # the first stage embeds for the target
    (0, 2, "dspark", "kv_producer", True),  # ... on a producer too
    (0, 3, "dspark", "kv_producer", True),
]


def target_of(config: Config, load: bool = True) -> nn.Module:
    """The registry's class for `config.model`, built for this process's ranks and
    (unless `load` is False) loaded."""
    target = get_model_class(config.hf_config.architecture)(config)
    if load:
        load_weights(target, config.model)
    return target.eval()


def build_target(model: str, **config_kwargs) -> tuple[nn.Module, Config]:
    """`target_of` a `Config(model=model, **config_kwargs)`, loaded."""
    config = Config(model=model, **config_kwargs)
    return target_of(config), config


def bind_caches(
    model: nn.Module, num_blocks: int = 64, slots: int = 4, spec_rows: int = 0
) -> CacheEngine:
    dtype = next(model.parameters()).dtype
    return CacheEngine([model], num_blocks, BLOCK_SIZE, slots, spec_rows, "cpu", dtype)


def work(
    token_ids: list[int],
    context_len: int = 0,
    slot: int = 0,
    num_drafts: int = 0,
    first_block: int = 0,
    num_blocks: int = 16,
) -> SeqWork:
    """One sequence's rows; blocks first_block.. are its block table."""
    return SeqWork(
        seq_id=slot,
        token_ids=list(token_ids),
        context_len=context_len,
        block_table=list(range(first_block, first_block + num_blocks)),
        state_slot=slot,
        num_drafts=num_drafts,
    )


@torch.inference_mode()
def forward_rows(
    model: nn.Module,
    works: list[SeqWork],
    intermediate: IntermediateTensors | None = None,
) -> torch.Tensor | IntermediateTensors:
    """One forward of `works` (hidden states on the last stage, else the payload)."""
    input_ids, positions, metadata = prepare_inputs(works, BLOCK_SIZE, "cpu")
    with set_forward_context(ForwardContext(metadata)):
        return model(input_ids, positions, intermediate)


@torch.inference_mode()
def logits_of(model: nn.Module, works: list[SeqWork]) -> torch.Tensor:
    return model.compute_logits(forward_rows(model, works))


class PaddedRun(NamedTuple):
    """One forward's real-row logits, request-owned cache rows and metadata."""

    logits: torch.Tensor
    cache_rows: list[torch.Tensor]
    metadata: AttentionMetadata


@torch.inference_mode()
def run_padded(
    model: nn.Module,
    works: list[SeqWork],
    cache: CacheEngine,
    padding: SeqPadding | None,
) -> PaddedRun:
    """One forward of `works` with `padding` (or none) at a 20-block table width;
    its cache rows are the request-owned KV rows and recurrent states, what a
    captured graph's padded layout must leave unchanged."""
    ids, positions, metadata = prepare_inputs(
        works, BLOCK_SIZE, "cpu", table_width=20, padding=padding
    )
    with set_forward_context(ForwardContext(metadata)):
        hidden = model(ids, positions)
    real = sum(w.num_rows for w in works)
    blocks, slots = cache.num_blocks, cache.num_state_slots
    rows = [m.kv_cache[:blocks].clone() for m in cache.kv_layers]
    for m in cache.state_layers:
        rows += [m.ssm_state[:slots].clone(), m.conv_state[:slots].clone()]
    return PaddedRun(model.compute_logits(hidden[:real]), rows, metadata)


def padded_decode_runs(
    model: nn.Module, prompts: list[list[int]], rows: list[list[int]], num_drafts: int
) -> tuple[PaddedRun, PaddedRun]:
    """One decode (or verify) step of `rows` after prefilling `prompts`, on fresh
    caches each time: (unpadded, padded with dummy sequences to 5)."""
    decode = [
        work(rows[i], len(prompts[i]), slot=i, num_drafts=num_drafts,
             first_block=16 * i)
        for i in range(len(prompts))
    ]  # fmt: skip
    runs = []
    for padded in (False, True):
        cache = bind_caches(model, num_blocks=32, slots=2, spec_rows=4)
        logits_of(
            model, [work(p, slot=i, first_block=16 * i) for i, p in enumerate(prompts)]
        )
        padding = SeqPadding(5, cache.scratch_kv_slot, cache.scratch_state_slot)
        runs.append(run_padded(model, decode, cache, padding if padded else None))
    return runs[0], runs[1]


def padded_prefill_runs(
    model: nn.Module, works: list[SeqWork], shape: PrefillShape
) -> tuple[PaddedRun, PaddedRun]:
    """One prefill of `works` on fresh caches each time: (unpadded, laid out as
    `shape`'s capture)."""
    runs = []
    for padded in (False, True):
        cache = bind_caches(model, num_blocks=32, slots=2)
        padding = shape.padding(cache.scratch_kv_slot, cache.scratch_state_slot)
        runs.append(run_padded(model, works, cache, padding if padded else None))
    return runs[0], runs[1]


def assert_padding_changes_nothing(
    unpadded: PaddedRun, padded: PaddedRun, tol: dict
) -> None:
    """The real rows' logits and every request-owned cache row are unchanged."""
    torch.testing.assert_close(padded.logits, unpadded.logits, **tol)
    for rows, padded_rows in zip(unpadded.cache_rows, padded.cache_rows):
        torch.testing.assert_close(padded_rows, rows, **tol)


def cache_name(reference: nn.Module) -> str:
    """The name of a transformers model's cache, as argument and output field: 5.25
    renamed `past_key_values` to `cache`; the project allows versions on either side."""
    parameters = inspect.signature(reference.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@torch.no_grad()
def assert_greedy_decode_matches(
    reference: nn.Module,
    model: nn.Module,
    prompt: list[int],
    new_tokens: int,
    tol: dict,
) -> None:
    """Prefill `prompt`, then decode `new_tokens` greedily one token at a time, the
    transformers `reference` through its own cache and atom's `model` through freshly
    bound caches: logits agree within `tol` at every step, and so do the tokens."""
    bind_caches(model)
    name = cache_name(reference)
    out = reference(torch.tensor([prompt]), use_cache=True)
    cache, ref_logits = out[name], out.logits[0, -1]
    atom_logits = logits_of(model, [work(prompt)])[-1]
    ref_tokens, atom_tokens = [], []
    for step in range(new_tokens):
        torch.testing.assert_close(atom_logits, ref_logits, **tol)
        ref_tokens.append(int(ref_logits.argmax()))
        atom_tokens.append(int(atom_logits.argmax()))
        if atom_tokens != ref_tokens:
            break
        token = ref_tokens[-1]
        out = reference(torch.tensor([[token]]), use_cache=True, **{name: cache})
        cache, ref_logits = out[name], out.logits[0, -1]
        atom_logits = logits_of(model, [work([token], len(prompt) + step)])[0]
    assert atom_tokens == ref_tokens
    assert len(atom_tokens) == new_tokens
    assert len(set(atom_tokens)) > 1, "a constant continuation would prove little"


@torch.no_grad()
def randomize(model: nn.Module, seed: int) -> None:
    """Seeded weights of a transformers Kimi model: O(1) activations, norms and
    router bias away from their trivial init; A_log and dt_bias keep the FLA init."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        noise = torch.randn(tensor.shape, generator=gen)
        if name.endswith(("A_log", "dt_bias")):
            continue
        if "norm" in name:
            tensor.copy_(1.0 + 0.1 * noise)
        elif name.endswith("e_score_correction_bias"):
            tensor.copy_(0.05 * noise)
        elif "embed_tokens" in name:
            tensor.copy_(noise)
        elif tensor.dim() >= 2:
            tensor.copy_(noise / tensor.shape[-1] ** 0.5)


# Tiny widths as `KimiLinearConfig` keywords, for cases that keep transformers'
# defaults everywhere else; num_key_value_heads must match the head count, which
# transformers' default (32) does not.
TRANSFORMERS_TINY_WIDTHS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TRANSFORMERS_TINY_KDA_WIDTHS = {"num_heads": 4, "head_dim": 16}
# q-LoRA, MLA first, every layer MoE: the schedule transformers' defaults never give.
TRANSFORMERS_MLA_FIRST_ALL_MOE = dict(
    num_hidden_layers=4,
    q_lora_rank=32,
    linear_attn_config={
        **TRANSFORMERS_TINY_KDA_WIDTHS,
        "kda_layers": [2, 4],
        "full_attn_layers": [1, 3],
    },
    first_k_dense_replace=0,
)


def transformers_tiny_kl_config(q_lora_rank: int | None):
    """TINY-KL (atom/models/tiny/configs.py) as transformers' `KimiLinearConfig`, with
    `q_lora_rank` chosen per case and eager attention (no hub kernels)."""
    from transformers import KimiLinearConfig

    text = dict(kimi_linear_config(), q_lora_rank=q_lora_rank)
    return KimiLinearConfig(**text, attn_implementation="eager")


def k3_full_size_text() -> dict:
    """A K3 text config with the published schedule (93 layers, MLA at 1-based 4,
    8, ..., 92 and 93, AttnRes blocks of 12) and head counts on tiny widths."""
    text = k3_text_config()
    full = list(range(4, 93, 4)) + [93]
    text.update(
        num_hidden_layers=93,
        vocab_size=163840,
        num_attention_heads=96,
        num_key_value_heads=96,
        intermediate_size=33792,
        moe_intermediate_size=3072,
        attn_res_block_size=12,
    )
    text["linear_attn_config"] = dict(
        text["linear_attn_config"],
        num_heads=96,
        full_attn_layers=full,
        kda_layers=[i for i in range(1, 94) if i not in full],
    )
    return text
