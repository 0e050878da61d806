"""How much device memory a rank's KV cache may take, found by running the worst
steps once before the cache exists, as serving engines profile.

The profile binds a cache with nothing but the scratch block and state slot, then
runs, each on dummy rows that write only there:
- the largest prefill step (max_num_batched_tokens rows, split into sequences no
  longer than max_model_len);
- the largest decode step: max_num_seqs sequences of T + 1 rows at the full block
  table width (what the captured graphs allocate), through the LM head;
- with graphs, the largest captured short prefill (one prompt and the dummy
  sequence that pads it, `cuda_graph.PrefillShape`);
- on a proposing last stage, DSpark's block pass at max_num_seqs.
Each step's activation peak is measured on its own. Captured graphs keep their
pools for the engine's life, beside the eager allocator's cached blocks, so with
graphs the captured steps' peaks (the larger of the decode step's and the short
prefill's, as the target's captures share one pool) and the block pass's are
counted on top of the prefill's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atom.model_engine.batch import SeqWork
from atom.model_engine.cuda_graph import PrefillShape
from atom.model_engine.model_inputs import SeqPadding, prepare_inputs
from atom.utils.arithmetic import ceil_div
from atom.utils.forward_context import ForwardContext, set_forward_context

if TYPE_CHECKING:
    from atom.model_engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GiB = float(1 << 30)


@dataclass(frozen=True)
class ActivationPeaks:
    """Peak bytes above the weights of each profiled step."""

    prefill: int
    # The largest captured target step: decode, or with graphs a short prefill.
    decode: int
    block_pass: int

    def reserved(self, with_graphs: bool) -> int:
        if with_graphs:
            return self.prefill + self.decode + self.block_pass
        return max(self.prefill, self.decode, self.block_pass)


def _dummy(length: int, context_len: int, width: int, runner: ModelRunner) -> SeqWork:
    cache = runner.cache
    return SeqWork(
        seq_id=0,
        token_ids=[0] * length,
        context_len=context_len,
        block_table=[0] * width,
        state_slot=cache.scratch_state_slot,
        sample=False,
        num_drafts=0,
    )


def _forward(
    runner: ModelRunner, works: list[SeqWork], padding: SeqPadding | None = None
) -> torch.Tensor:
    limits = runner.limits
    width = limits.max_blocks_per_seq if padding is not None else None
    ids, positions, metadata = prepare_inputs(
        works, limits.block_size, runner.device, width, padding
    )
    # Every row lands on the scratch block, whatever the tables say.
    metadata.slot_mapping.fill_(runner.cache.scratch_kv_slot)
    received = None
    if not runner.is_first_stage:
        received = runner.model.make_empty_intermediate_tensors(
            ids.numel(), runner.dtype, runner.device
        )
    with set_forward_context(ForwardContext(metadata)):
        out = runner.model(ids, positions, received)
    if runner.is_last_stage:
        out = runner.model.compute_logits(out)
    return out


def profile_prefill(runner: ModelRunner) -> None:
    limits = runner.limits
    remaining, works = limits.max_num_batched_tokens, []
    while remaining > 0:
        length = min(remaining, limits.max_model_len)
        works.append(_dummy(length, 0, ceil_div(length, limits.block_size), runner))
        remaining -= length
    _forward(runner, works)


def profile_decode(runner: ModelRunner) -> None:
    limits = runner.limits
    rows = limits.num_speculative_tokens + 1
    works = [
        _dummy(rows, 1, limits.max_blocks_per_seq, runner)
        for _ in range(limits.max_num_seqs)
    ]
    for work in works:
        work.num_drafts = rows - 1
    _forward(runner, works)


def profile_short_prefill(runner: ModelRunner) -> None:
    shapes = [s for s in runner.graph_shapes() if isinstance(s, PrefillShape)]
    if not shapes:
        return
    shape = max(shapes, key=lambda s: (s.num_tokens, s.padded))
    cache = runner.cache
    work = shape.dummy(runner.limits.max_blocks_per_seq, cache.scratch_state_slot)
    _forward(
        runner,
        [work],
        shape.padding(cache.scratch_kv_slot, cache.scratch_state_slot),
    )


def profile_block_pass(runner: ModelRunner) -> None:
    if runner.proposer is None:
        return
    limits = runner.limits
    count = limits.max_num_seqs
    zeros = torch.zeros(count, dtype=torch.long, device=runner.device)
    tables = torch.zeros(
        count, limits.max_blocks_per_seq, dtype=torch.long, device=runner.device
    )
    runner.proposer.model.block_forward(
        zeros, zeros, tables, limits.num_speculative_tokens
    )


def _peak_above(step, runner: ModelRunner, base: int) -> int:
    torch.cuda.reset_peak_memory_stats(runner.device)
    step(runner)
    torch.cuda.synchronize(runner.device)
    return max(0, torch.cuda.max_memory_allocated(runner.device) - base)


@torch.inference_mode()
def measure_activation_peaks(
    runner: ModelRunner, with_graphs: bool = False
) -> ActivationPeaks:
    """Run the profile steps on `runner` (its cache must be the scratch-only one)
    and return their peaks; the eager allocator's blocks are released after."""
    torch.cuda.synchronize(runner.device)
    base = torch.cuda.memory_allocated(runner.device)
    prefill = _peak_above(profile_prefill, runner, base)
    decode = _peak_above(profile_decode, runner, base)
    if with_graphs:
        decode = max(decode, _peak_above(profile_short_prefill, runner, base))
    peaks = ActivationPeaks(
        prefill=prefill,
        decode=decode,
        block_pass=_peak_above(profile_block_pass, runner, base),
    )
    torch.cuda.empty_cache()
    return peaks


def kv_budget_bytes(
    runner: ModelRunner, ranks_on_device: int, with_graphs: bool, state_bytes: int
) -> int:
    """Bytes this rank's KV blocks may take under --gpu-memory-utilization.

    The device's share of this rank is total x utilisation / ranks on the device;
    from it come the rank's tensors (weights), the profiled activations, the state
    slots and its part of the memory torch does not own (CUDA context, libraries,
    other processes)."""
    device = runner.device
    start = time.perf_counter()
    peaks = measure_activation_peaks(runner, with_graphs)
    free, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    foreign = max(0, total - free - torch.cuda.memory_reserved(device))
    share = total * runner.config.gpu_memory_utilization / ranks_on_device
    activations = peaks.reserved(with_graphs)
    budget = int(
        share - weights - activations - state_bytes - foreign / ranks_on_device
    )
    logger.info(
        "memory profile %s (%.1f s): share %.2f GiB = weights %.2f + activations "
        "%.2f (prefill %.2f, decode %.2f, block pass %.2f%s) + state %.2f + other "
        "%.2f + KV %.2f",
        runner.rank_label(),
        time.perf_counter() - start,
        share / GiB,
        weights / GiB,
        activations / GiB,
        peaks.prefill / GiB,
        peaks.decode / GiB,
        peaks.block_pass / GiB,
        ", graph pools kept" if with_graphs else "",
        state_bytes / GiB,
        foreign / ranks_on_device / GiB,
        max(budget, 0) / GiB,
    )
    return budget
