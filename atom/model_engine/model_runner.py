"""One rank's model: build, load, bind caches, and run scheduled batches.

Stage order inside `execute`: commit the previous verify's KDA rows and fork prefix
states -> receive the previous stage's payload -> forward -> save state checkpoints ->
send to the next stage, or (last stage) write the draft's context KV, let the step
sampler choose tokens and propose the next drafts, and return the launched step;
`finish` turns it into the batch's one BatchOutput once its tokens are on the host
(async scheduling launches the next batch in between).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from atom.config import Config
from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.distributed.pp_comm import recv_tensor_dict, send_tensor_dict
from atom.kernels import triton_available
from atom.kv_transfer.connector import KVConnectorWorker
from atom.kv_transfer.regions import RankLayout
from atom.model_engine.batch import BatchOutput, ScheduledBatch, SeqWork
from atom.model_engine.cache_engine import CacheEngine
from atom.model_engine.cuda_graph import (
    DecodeShape,
    GraphShape,
    PrefillShape,
    StepGraphs,
    capture_sizes,
    prefill_capture_sizes,
)
from atom.model_engine.memory_ledger import log_memory_ledger, memory_ledger
from atom.model_engine.memory_profile import kv_budget_bytes
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_engine.pending_tokens import (
    InputFiller,
    PendingRows,
    SampledTokens,
    pending_rows,
)
from atom.model_engine.step_sampler import SampledStep, StepSampler
from atom.model_loader.build import building_on, load_target
from atom.model_ops.paged_cache import resolve_kv_cache_dtype
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.models.interfaces import (
    STATE_ROLLBACK_MODE,
    RecurrentStateLayer,
    is_graph_capturable,
)
from atom.models.registry import check_pp_support, draft_tap_ids
from atom.models.utils import IntermediateTensors, language_model_of
from atom.spec_decode.drafter import Drafter
from atom.spec_decode.factory import build_drafter
from atom.spec_decode.pp_aux_relay import AUX_KEY, PPAuxRelay
from atom.utils.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger(__name__)

# Start-up markers with fixed wording: CI counts them in the server log
# (scripts/ci/server_log.py). The relay line comes once per TP rank of every stage
# that arms taps for the next one, the rollback line once per rank whose KDA layers
# keep per-row snapshots for speculation: 4 and 8 lines at pp2 x tp4 for Kimi-K3.
RELAY_MARKER = "[PPAuxRelay]"
KDA_ROLLBACK_MARKER = "[KDA rollback]"

# KV cache budget on CPU, where there is no device memory to measure.
CPU_KV_BUDGET_BYTES = 1 << 30


@dataclass
class LaunchedStep:
    """A batch whose tokens are chosen on the device but not yet on the host."""

    batch: ScheduledBatch
    sampled: SampledStep


class ModelRunner:
    def __init__(self, config: Config, device: torch.device) -> None:
        check_pp_support(config)
        self.config = config
        self.limits = config.limits
        self.device = device
        self.dtype = config.torch_dtype
        # Checked before loading: a device that cannot hold fp8 rows fails fast.
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, device)
        self.pp = get_pp_group()
        self.is_last_stage = self.pp.is_last_rank
        self.is_first_stage = self.pp.is_first_rank
        start = time.perf_counter()
        self.model, self.load_report = load_target(config, device)
        self.drafter = self._build_drafter()
        logger.info(
            "%s: built and loaded the model%s in %.1f s",
            self.rank_label(),
            " and its draft" if self.drafter else "",
            time.perf_counter() - start,
        )
        self.relay = self._build_relay()
        # No proposer without speculation or on a context-only producer.
        self.proposer = (
            self.drafter if self.drafter and self.drafter.will_propose else None
        )
        # The step's bookkeeping between graph replays (the greedy verify, the
        # pending rows) in one launch each on a GPU, where every torch operator
        # there is a launch the host pays for.
        self.bookkeeping_kernels = device.type == "cuda" and triton_available(device)
        self.step_sampler = StepSampler(
            self.proposer, greedy_verify_kernel=self.bookkeeping_kernels
        )
        # The last sampling batch's tokens, for inputs async scheduling left pending.
        self.sampled: SampledTokens | None = None
        # The last step's sampling metadata, whose tensors steady decode reuses.
        self.last_sampling: SamplingMetadata | None = None
        self.cache: CacheEngine | None = None
        self.graphs: StepGraphs | None = None
        self.use_graphs = self._can_capture_graphs()
        # P/D (kv_transfer/rank_calls.py): set once the caches are registered.
        self.kv_connector: KVConnectorWorker | None = None
        self.kv_layout: RankLayout | None = None
        self.memory_ledger = memory_ledger(self.model, self.drafter)
        log_memory_ledger(self.memory_ledger)

    def _build_drafter(self) -> Drafter | None:
        if self.config.speculative_config is None or not self.is_last_stage:
            return None
        drafter = build_drafter(self.config)
        with building_on(self.device, self.dtype):
            drafter.load_model(self.model)
        return drafter

    def _build_relay(self) -> PPAuxRelay | None:
        spec = self.config.speculative_config
        if spec is None or self.pp.world_size == 1:
            return None
        relay = PPAuxRelay(
            language_model_of(self.model).model,
            draft_tap_ids(spec.draft_hf_config),
            int(self.config.hf_config.text["hidden_size"]),
            self.config.max_num_batched_tokens,
            self.device,
            self.dtype,
        )
        if relay.arms_taps:
            logger.info("%s %s: %s", RELAY_MARKER, self.rank_label(), relay.describe())
        return relay

    def rank_label(self) -> str:
        return f"pp_rank {self.pp.rank_in_group} tp_rank {get_tp_group().rank_in_group}"

    @property
    def has_recurrent_state(self) -> bool:
        return any(isinstance(m, RecurrentStateLayer) for m in self.model.modules())

    def cache_modules(self) -> list[torch.nn.Module]:
        return [self.model] + ([self.drafter.model] if self.drafter else [])

    def max_kv_blocks(self) -> int:
        """KV blocks this rank can hold; the engine takes the minimum over ranks.

        On CUDA the worst steps run once first (`memory_profile.py`), so the
        activations and graph pools they need are not handed to the cache."""
        if self.config.num_kvcache_blocks:
            return self.config.num_kvcache_blocks
        limits = self.limits
        self.cache = self._cache_engine(num_blocks=0, num_state_slots=0)
        per_block = max(self.cache.kv_bytes_per_block(), 1)
        state = self.cache.state_bytes_per_slot() * limits.num_state_slots
        if self.device.type == "cuda":
            budget = kv_budget_bytes(
                self, self._ranks_on_device(), self.use_graphs, state
            )
        else:
            budget = CPU_KV_BUDGET_BYTES - state
        # A slot's state is its state row plus one snapshot row per verify row.
        rows = 1 + self.cache.num_verify_rows
        self.cache = None
        limits.check_draft_room(budget + state, per_block, state // rows)
        wanted = limits.max_num_seqs * limits.max_blocks_per_seq
        return max(1, min(wanted, budget // per_block))

    def _ranks_on_device(self) -> int:
        # Ranks take GPUs round-robin (worker.rank_device).
        world = self.config.parallel_config.world_size
        count = torch.cuda.device_count()
        return len(range(self.device.index or 0, world, count))

    def allocate_caches(self, num_blocks: int) -> None:
        self.cache = self._cache_engine(num_blocks, self.limits.num_state_slots)
        if self.cache.num_verify_rows and self.cache.state_layers:
            logger.info(
                "%s %s: %s of %d KDA layers, %d rows per state slot",
                KDA_ROLLBACK_MARKER,
                self.rank_label(),
                STATE_ROLLBACK_MODE,
                len(self.cache.state_layers),
                self.cache.num_verify_rows,
            )
        if self.use_graphs:
            self.graphs = self._capture_graphs()

    def _cache_engine(self, num_blocks: int, num_state_slots: int) -> CacheEngine:
        # A verify keeps the state after each of its T + 1 rows.
        num_speculative_tokens = self.limits.num_speculative_tokens
        return CacheEngine(
            self.cache_modules(),
            num_blocks,
            self.limits.block_size,
            num_state_slots,
            num_speculative_tokens + 1 if num_speculative_tokens else 0,
            self.device,
            self.dtype,
            self.kv_dtype,
        )

    def _can_capture_graphs(self) -> bool:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return False
        blockers = []
        tp = get_tp_group()
        if tp.world_size > 1 and dist.get_backend(tp.device_group) != "nccl":
            blockers.append("tensor-parallel ranks share a GPU over gloo")
        uncapturable = sorted(
            {
                type(m).__name__
                for m in self.model.modules()
                if not is_graph_capturable(m)
            }
        )
        if uncapturable:
            blockers.append(f"{', '.join(uncapturable)} sync with the host here")
        if blockers:
            logger.info("running eagerly: %s", "; ".join(blockers))
        return not blockers

    def decode_capture_sizes(self) -> list[int]:
        """Decode batch sizes captured, by the target's graphs and the block pass's."""
        return capture_sizes(
            self.config.cudagraph_capture_sizes, self.limits.max_num_seqs
        )

    def graph_shapes(self) -> list[GraphShape]:
        """The step shapes this rank captures (`model_engine/cuda_graph.py`)."""
        limits = self.limits
        rows = sorted({1, limits.num_speculative_tokens + 1})
        shapes: list[GraphShape] = [
            DecodeShape(size, query_len)
            for size in self.decode_capture_sizes()
            for query_len in rows
        ]
        # A prompt that fills a size takes it unpadded, a shorter one padded.
        prefill_tokens = min(limits.max_num_batched_tokens, limits.max_model_len)
        shapes += [
            PrefillShape(tokens, padded)
            for tokens in prefill_capture_sizes(
                self.config.prefill_capture_sizes, prefill_tokens
            )
            for padded in (False, True)
        ]
        return shapes

    @torch.inference_mode()
    def _capture_graphs(self) -> StepGraphs:
        table_width = self.limits.max_blocks_per_seq
        if self.proposer is not None:
            self.proposer.capture_graphs(self.decode_capture_sizes(), table_width)
        return StepGraphs(
            self.model,
            self.graph_shapes(),
            self.limits.block_size,
            table_width,
            (self.cache.scratch_kv_slot, self.cache.scratch_state_slot),
            self.is_first_stage,
            self.device,
            self.dtype,
            self._draft_context_writer(),
        )

    def _draft_context_writer(
        self,
    ) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """The drafter's context write, to be captured with the step graphs, or
        None to keep it eager: without a drafter, and where taps arrive from earlier
        stages (the relay hands them over outside the graph)."""
        if self.drafter is None or (self.relay is not None and self.relay.incoming):
            return None
        drafter = self.drafter

        def write(positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
            drafter.precompute_context_kv(positions, slot_mapping, positions.numel())

        return write

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> LaunchedStep | None:
        """Run `batch` up to its sampling, without waiting for the device; on the
        last stage, the launched step whose `finish` is the batch's BatchOutput."""
        self.cache.commit(
            [slot for slot, _ in batch.spec_commits],
            [rows for _, rows in batch.spec_commits],
        )
        forks = [work for work in batch.work if work.state_fork_src is not None]
        self.cache.copy_states(
            [work.state_fork_src for work in forks], [work.state_slot for work in forks]
        )
        self.step_sampler.forget(batch.finished_seq_ids)
        num_tokens = batch.num_tokens
        graphs = self.graphs
        graph_key = graphs.shape_for(batch.work) if graphs is not None else None
        received, taps_in = None, None
        if not self.is_first_stage:
            # A replayed step receives straight into its graph's static payload.
            into = graphs.payload.tensors if graph_key is not None else None
            payload = recv_tensor_dict(self.device, self._expected_keys(), into)
            taps_in = payload.pop(AUX_KEY, None)
            received = IntermediateTensors(payload)
        pending = pending_rows(
            batch,
            self.sampled,
            self.limits.block_size,
            self.device,
            kernel=self.bookkeeping_kernels,
        )
        fill = None
        if pending is not None:
            fill = partial(pending.fill, commit=self.cache.commit_rows)
        out, positions, slot_mapping = self._forward(
            batch.work, received, graph_key, fill
        )
        saves = [work for work in batch.work if work.state_save_dst is not None]
        self.cache.copy_states(
            [work.state_slot for work in saves], [work.state_save_dst for work in saves]
        )
        if not self.is_last_stage:
            payload = dict(out.items())
            if self.relay is not None:
                packed = self.relay.pack(taps_in, num_tokens)
                if packed is not None:
                    payload[AUX_KEY] = packed
            send_tensor_dict(payload)
            return None
        # A replayed graph wrote the draft's context rows already (_capture_graphs).
        context_written = (
            graph_key is not None and self.graphs.after_forward is not None
        )
        return self._sample_and_draft(
            batch, out, positions, slot_mapping, taps_in, context_written, pending
        )

    def _forward(
        self,
        works: list[SeqWork],
        received: IntermediateTensors | None,
        graph_key: GraphShape | None,
        fill: InputFiller | None = None,
    ) -> tuple[torch.Tensor | IntermediateTensors, torch.Tensor, torch.Tensor]:
        """(stage output, positions, slot mapping) of the batch's rows: the captured
        graph of `graph_key` (StepGraphs.shape_for) replays, or it runs eagerly;
        `fill` writes the pending inputs first."""
        if graph_key is not None:
            return self.graphs.run(graph_key, works, received, fill)
        input_ids, positions, metadata = prepare_inputs(
            works, self.limits.block_size, self.device, fill=fill
        )
        with set_forward_context(ForwardContext(metadata)):
            out = self.model(input_ids, positions, received)
        return out, positions, metadata.slot_mapping

    def _expected_keys(self) -> set[str]:
        # The model declares its payload (models/interfaces.py): nothing is allocated
        # per step just to learn the names.
        keys = set(self.model.pp_payload_keys)
        if self.relay is not None and self.relay.incoming:
            keys.add(AUX_KEY)
        return keys

    def _sample_and_draft(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        taps_in: torch.Tensor | None,
        context_written: bool,
        pending: PendingRows | None = None,
    ) -> LaunchedStep | None:
        """Last stage: write the draft's context for this forward's rows (unless
        the replayed graph did); when the batch samples, launch the choice of each
        sampled sequence's tokens and next drafts (`pending`: the rows async
        scheduling left to the device)."""
        num_tokens = positions.numel()
        if self.drafter is not None and not context_written:
            relayed = None
            if self.relay is not None:
                relayed = self.relay.unpack(taps_in, num_tokens)
            self.drafter.precompute_context_kv(
                positions, slot_mapping, num_tokens, relayed
            )
        self.step_sampler.record_prompt_logprobs(
            batch.work, hidden, self.model.compute_logits
        )
        if not batch.produces_output:
            return None
        sampling = SamplingMetadata.from_works(
            batch.work,
            self.device,
            drafts_next=self.proposer is not None,
            previous=self.last_sampling,
        )
        self.last_sampling = sampling
        if pending is not None:
            pending.fix_sampling(sampling)
        logits = self.model.compute_logits(sampling.scored_rows(hidden))
        sampled = self.step_sampler.launch(logits, sampling)
        self.sampled = SampledTokens(batch, sampled.next_inputs, sampled.accepted)
        return LaunchedStep(batch, sampled)

    def finish(self, launched: LaunchedStep) -> BatchOutput:
        """The launched step's BatchOutput, once its tokens reach the host."""
        choices = launched.sampled.choices()
        self.step_sampler.attach_prompt_logprobs(launched.batch.work, choices)
        return BatchOutput(launched.batch.batch_id, choices)
