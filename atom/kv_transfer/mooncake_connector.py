"""The connector over Mooncake's transfer engine (`mooncake-transfer-engine`).

Every rank starts one engine with Mooncake's peer-to-peer handshake and registers
its regions. The consumer reads: each of its ranks pulls, for every local region,
the producer rank of the same TP rank that owns that name (under PP on the
producer, each stage owns its own layers' names), the request's blocks and its
committed KDA slot. The producer only holds the blocks until the consumer's
release, or until its lease runs out.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from atom.kv_transfer.config import KVTransferConfig
from atom.kv_transfer.connector import (
    ConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    ReqMeta,
)
from atom.kv_transfer.peer import HttpPeer, PeerError
from atom.kv_transfer.regions import (
    BLOCK,
    DRAFT_PREFIX,
    EngineLayout,
    LayoutMismatch,
    RankLayout,
    Region,
    check_same_layout,
)
from atom.utils.api_key import api_key_from_env
from atom.utils.arithmetic import ceil_div

if TYPE_CHECKING:
    from atom.model_engine.sequence import Sequence

logger = logging.getLogger(__name__)

MOONCAKE_MISSING = (
    "the mooncake connector needs Mooncake's transfer engine: "
    'pip install -e ".[pd]" (and, on Debian or Ubuntu, '
    "apt-get install -y libibverbs1 librdmacm1 libnuma1)"
)


def wants_remote_decode(seq: Sequence) -> bool:
    params = seq.kv_transfer_params or {}
    return bool(params.get("do_remote_decode"))


def wants_remote_prefill(seq: Sequence) -> bool:
    params = seq.kv_transfer_params or {}
    return bool(params.get("do_remote_prefill"))


class MooncakeSchedulerConnector(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        # Set by the engine once the ranks registered their regions.
        self.local_layout: EngineLayout | None = None
        self._queued: list[Sequence] = []
        self._failures: dict[int, str] = {}
        self._peer_layouts: dict[str, EngineLayout] = {}
        # The side channel to producers (peer.py); anything with its two methods.
        self.peer = HttpPeer(config.peer_timeout_s, api_key_from_env())
        # Releases go out in the background: decoding never waits on a producer.
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="atom-kv-release")
        self._releases: list[Future] = []

    # ---- consumer ----
    def get_num_new_matched_tokens(self, seq: Sequence) -> tuple[int, bool]:
        if self.config.is_producer or not wants_remote_prefill(seq):
            return 0, False
        return seq.num_prompt_tokens, True

    def update_state_after_alloc(self, seq: Sequence) -> None:
        self._queued.append(seq)

    def build_connector_meta(self) -> ConnectorMetadata:
        meta = ConnectorMetadata()
        for seq in self._queued:
            try:
                meta.reqs_to_recv.append(self._req_meta(seq))
            except Exception as error:  # this request's to fail, not the engine's
                self._failures[seq.seq_id] = f"{type(error).__name__}: {error}"
        self._queued = []
        return meta

    def _req_meta(self, seq: Sequence) -> ReqMeta:
        params = seq.kv_transfer_params
        if params.get("num_prompt_tokens") != seq.num_prompt_tokens:
            raise ValueError(
                f"prompt of {seq.num_prompt_tokens} tokens here, "
                f"{params.get('num_prompt_tokens')} on the producer"
            )
        remote = self._peer_layout(params["remote_url"])
        check_same_layout(self.local_layout, remote, self.config.allow_cold_draft)
        num_blocks = ceil_div(seq.num_prompt_tokens, self.local_layout.block_size)
        remote_blocks = [int(b) for b in params["remote_block_ids"]][:num_blocks]
        if len(remote_blocks) != num_blocks:
            raise ValueError(
                f"{len(remote_blocks)} remote blocks for {num_blocks} prompt blocks"
            )
        slot = params.get("remote_state_slot")
        return ReqMeta(
            seq_id=seq.seq_id,
            local_block_ids=list(seq.block_table[:num_blocks]),
            local_state_slot=seq.state_slot,
            remote_block_ids=remote_blocks,
            remote_state_slot=None if slot is None else int(slot),
            remote=remote,
        )

    def _peer_layout(self, url: str) -> EngineLayout:
        # A producer's layout is fixed for its life: one handshake per producer.
        if url not in self._peer_layouts:
            self._peer_layouts[url] = self.peer.layout(url)
        return self._peer_layouts[url]

    def abort(self, seq: Sequence) -> None:
        self._queued = [queued for queued in self._queued if queued is not seq]
        self.request_received(seq, ok=False)

    def take_failures(self) -> dict[int, str]:
        failures, self._failures = self._failures, {}
        return failures

    def request_received(self, seq: Sequence, ok: bool) -> None:
        params = seq.kv_transfer_params or {}
        url = params.get("remote_url")
        if url is None:
            return
        if not ok:
            # The layout may have been the cause; ask again next time.
            self._peer_layouts.pop(url, None)
        self._releases = [f for f in self._releases if not f.done()]
        self._releases.append(
            self._releaser.submit(self._release, url, params.get("transfer_id"))
        )

    def _release(self, url: str, transfer_id: int | None) -> None:
        try:
            self.peer.release(url, transfer_id)
        except PeerError as error:
            # Its lease frees the blocks anyway.
            logger.warning("release of transfer %s: %s", transfer_id, error)

    def drain_releases(self) -> None:
        """Wait until every release sent so far has been answered (or failed)."""
        wait(self._releases)
        self._releases = []

    # ---- producer ----
    def request_finished(self, seq: Sequence) -> tuple[bool, dict | None]:
        if not self.config.is_producer or not wants_remote_decode(seq):
            return False, None
        if seq.finish_reason == "abort" or not seq.output_token_ids:
            return False, None
        layout = self.local_layout
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": seq.seq_id,
            "remote_block_ids": list(seq.block_table),
            "remote_state_slot": seq.state_slot,
            "first_token_id": seq.output_token_ids[0],
            # A context-only producer proposes nothing (spec/pp_dspark.md section 8).
            "draft_token_ids": [],
            "num_prompt_tokens": seq.num_prompt_tokens,
            "remote_tp_size": layout.tp_size,
            "remote_pp_size": layout.pp_size,
            "kv_layout_fingerprint": layout.fingerprint(),
            "context_kv_only": True,
        }

    def lease_deadline(self) -> float:
        return time.monotonic() + self.config.kv_lease_timeout_s


class MooncakeWorkerConnector(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise RuntimeError(f"{MOONCAKE_MISSING} ({error})") from None
        self.engine = TransferEngine()
        status = self.engine.initialize(
            config.host, "P2PHANDSHAKE", config.protocol, config.device_name
        )
        if status != 0:
            raise RuntimeError(
                f"Mooncake's transfer engine did not start on {config.host} over "
                f"{config.protocol} (status {status})"
            )
        self.address = f"{config.host}:{self.engine.get_rpc_port()}"
        self.allow_cold_draft = config.allow_cold_draft
        self.regions: list[Region] = []
        self.tp_rank = 0
        self._done = KVConnectorOutput()

    def register_kv_caches(
        self, regions: list[Region], pp_rank: int, tp_rank: int
    ) -> RankLayout:
        status = self.engine.batch_register_memory(
            [r.base_addr for r in regions],
            [r.unit_bytes * r.num_units for r in regions],
        )
        if status != 0:
            raise RuntimeError(f"Mooncake refused to register the caches ({status})")
        self.regions, self.tp_rank = regions, tp_rank
        return RankLayout(pp_rank, tp_rank, self.address, list(regions))

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        # Reads complete before this returns: the step that follows may use them.
        for req in meta.reqs_to_recv:
            try:
                self._read(req)
            except Exception as error:
                self._done.failed_recving[req.seq_id] = (
                    f"{type(error).__name__}: {error}"
                )
            else:
                self._done.finished_recving.add(req.seq_id)

    def _read(self, req: ReqMeta) -> None:
        owners = {
            region.name: (rank.address, region)
            for rank in req.remote.ranks
            if rank.tp_rank == self.tp_rank
            for region in rank.regions
        }
        # Per producer rank: (local address, remote address, bytes) of every unit.
        reads: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for local in self.regions:
            if local.name not in owners:
                if self.allow_cold_draft and local.name.startswith(DRAFT_PREFIX):
                    continue  # left cold: the consumer asked for that
                raise LayoutMismatch(f"the producer has no region {local.name}")
            address, remote = owners[local.name]
            if local.kind == BLOCK:
                pairs = list(zip(req.local_block_ids, req.remote_block_ids))
            elif req.local_state_slot is None or req.remote_state_slot is None:
                raise ValueError(
                    f"region {local.name} needs a state slot on both sides"
                )
            else:
                pairs = [(req.local_state_slot, req.remote_state_slot)]
            for mine, theirs in pairs:
                reads[address].append(
                    (local.addr(mine), remote.addr(theirs), local.unit_bytes)
                )
        for address, units in reads.items():
            local_addrs, remote_addrs, lengths = (list(x) for x in zip(*units))
            status = self.engine.batch_transfer_sync_read(
                address, local_addrs, remote_addrs, lengths
            )
            if status < 0:
                raise RuntimeError(
                    f"Mooncake read of {len(units)} units from {address} failed "
                    f"(status {status})"
                )

    def get_finished(self) -> KVConnectorOutput:
        done, self._done = self._done, KVConnectorOutput()
        return done


# The names the factory looks up (factory.py).
SchedulerConnector = MooncakeSchedulerConnector
WorkerConnector = MooncakeWorkerConnector
