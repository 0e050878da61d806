"""What the engine asks of each rank for P/D, through `WorkerGroup.call` (module
level, so they pickle): attach the worker connector, report its layout, receive,
and propose the first drafts of received requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.kv_transfer.connector import ConnectorMetadata, KVConnectorOutput
from atom.kv_transfer.factory import create_worker_connector
from atom.kv_transfer.regions import cache_regions
from atom.model_ops.sampling_metadata import SamplingMetadata

if TYPE_CHECKING:
    from atom.model_engine.batch import SeqWork
    from atom.model_engine.model_runner import ModelRunner


def attach_kv_connector(runner: ModelRunner) -> None:
    """Start this rank's transfer engine and register its bound caches."""
    cache = runner.cache
    states = {id(layer): st for layer, st in zip(cache.state_layers, cache.states)}
    draft = runner.drafter.model if runner.drafter is not None else None
    regions = cache_regions(runner.model, draft, states)
    connector = create_worker_connector(runner.config.kv_transfer)
    runner.kv_layout = connector.register_kv_caches(
        regions, get_pp_group().rank_in_group, get_tp_group().rank_in_group
    )
    runner.kv_connector = connector


def rank_kv_layout(runner: ModelRunner) -> dict:
    return runner.kv_layout.to_dict()


def load_kv(meta: ConnectorMetadata, runner: ModelRunner) -> KVConnectorOutput:
    runner.kv_connector.start_load_kv(meta)
    return runner.kv_connector.get_finished()


@torch.inference_mode()
def bootstrap_drafts(
    works: list[SeqWork], anchors: list[int], runner: ModelRunner
) -> list[list[int]] | None:
    """The drafts each received request verifies first, on the last stage.

    A producer proposes nothing, but the aggregated engine drafts right after the
    prefill, anchored at the token it just sampled. With the draft's context rows
    received, the same proposal needs no target forward: `works` are the rows that
    decided each first token (their position is the anchor's) and `anchors` those
    tokens. Every TP rank of the last stage runs it (the draft is TP-sharded);
    other stages return None.
    """
    if runner.proposer is None:
        return None
    sampling = SamplingMetadata.from_works(works, runner.device, drafts_next=True)
    anchor_ids = torch.tensor(anchors, dtype=torch.long, device=runner.device)
    drafts = runner.proposer.propose(
        anchor_ids, sampling.positions, sampling.spec.block_tables, sampling
    )
    runner.step_sampler.store_draft_probs(sampling, drafts)
    return drafts.ids.tolist()
