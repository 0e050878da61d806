"""Shared helpers of the Kimi target tests: build, load, bind caches, run rows."""

from __future__ import annotations

import torch
from torch import nn

from atom.config import Config
from atom.model_engine.batch import SeqWork
from atom.model_engine.cache_engine import CacheEngine
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_loader.loader import load_weights
from atom.models.registry import get_model_class
from atom.models.utils import IntermediateTensors
from atom.utils.forward_context import ForwardContext, set_forward_context

BLOCK_SIZE = 4


def build_target(model: str, **config_kwargs) -> tuple[nn.Module, Config]:
    """The registry's class for `model`, built for this process's ranks and loaded."""
    config = Config(model=model, **config_kwargs)
    target = get_model_class(config.hf_config.architecture)(config)
    load_weights(target, config.model)
    return target.eval(), config


def bind_caches(
    model: nn.Module, num_blocks: int = 64, slots: int = 4, spec_rows: int = 0
) -> CacheEngine:
    dtype = next(model.parameters()).dtype
    return CacheEngine([model], num_blocks, BLOCK_SIZE, slots, spec_rows, "cpu", dtype)


def work(
    token_ids: list[int],
    context_len: int = 0,
    slot: int = 0,
    num_spec_tokens: int = 0,
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
        sample=True,
        num_spec_tokens=num_spec_tokens,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=None,
    )


@torch.inference_mode()
def forward_rows(
    model: nn.Module,
    seqs: list[SeqWork],
    intermediate: IntermediateTensors | None = None,
) -> torch.Tensor | IntermediateTensors:
    """One forward of `seqs` (hidden states on the last stage, else the payload)."""
    input_ids, positions, metadata = prepare_inputs(seqs, BLOCK_SIZE, "cpu")
    with set_forward_context(ForwardContext(metadata)):
        return model(input_ids, positions, intermediate)


@torch.inference_mode()
def logits_of(model: nn.Module, seqs: list[SeqWork]) -> torch.Tensor:
    return model.compute_logits(forward_rows(model, seqs))
