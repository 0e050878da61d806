"""The connector interface of P/D and the messages between its two halves.

The scheduler side lives in the engine process (stage 0's head) and decides, per
request, what to receive or hold; the worker side lives in every rank and moves its
own regions. One step's receives travel to the ranks as `ConnectorMetadata`; each
rank answers a `KVConnectorOutput`, and a request counts as received only when every
rank received it (`merge_outputs`): one failure fails it, and it is prefilled
locally instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from atom.kv_transfer.regions import EngineLayout, RankLayout, Region

if TYPE_CHECKING:
    from atom.model_engine.sequence import Sequence


@dataclass
class ReqMeta:
    """One request to receive: where its blocks and state slot are on each side."""

    seq_id: int
    local_block_ids: list[int]
    local_state_slot: int | None
    remote_block_ids: list[int]
    remote_state_slot: int | None
    remote: EngineLayout


@dataclass
class ConnectorMetadata:
    reqs_to_recv: list[ReqMeta] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    finished_recving: set[int] = field(default_factory=set)
    # seq_id -> why its receive failed.
    failed_recving: dict[int, str] = field(default_factory=dict)


def merge_outputs(
    outputs: list[KVConnectorOutput], expected: set[int]
) -> KVConnectorOutput:
    """Every rank's report on the receives `expected` into one: done when all ranks
    are done, failed when any failed (the first reason is kept) or when a rank did
    not report it (so a parked request never waits forever)."""
    merged = KVConnectorOutput()
    for output in outputs:
        for seq_id, reason in output.failed_recving.items():
            merged.failed_recving.setdefault(seq_id, reason)
    done = (
        set.intersection(*(o.finished_recving for o in outputs)) if outputs else set()
    )
    merged.finished_recving = (done & expected) - set(merged.failed_recving)
    for seq_id in expected - merged.finished_recving - set(merged.failed_recving):
        merged.failed_recving[seq_id] = "not every rank reported its receive"
    return merged


def check_remote_prefill_params(params: dict, vocab_size: int | None) -> None:
    """Refuse, with a ValueError naming the field, consumer params that would break
    the engine rather than just fail their receive (which falls back to prefill)."""
    if not params.get("do_remote_prefill"):
        return
    first = params.get("first_token_id")
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ValueError(
            f"kv_transfer_params.first_token_id must be a token id, got {first!r}"
        )
    if vocab_size is not None and first >= vocab_size:
        raise ValueError(
            f"kv_transfer_params.first_token_id {first} is outside the vocabulary "
            f"(size {vocab_size})"
        )
    if not isinstance(params.get("remote_url"), str):
        raise ValueError(
            "kv_transfer_params.remote_url must be the producer's URL (the router "
            "adds it)"
        )


class KVConnectorScheduler(ABC):
    """Scheduler side (engine process)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence) -> tuple[int, bool]:
        """(prompt tokens that will arrive from the peer, whether to park the
        request until they do)."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence) -> None:
        """The parked request has its blocks and state slot: queue its receive."""

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata:
        """The receives to start now; handshake failures go to `take_failures`."""

    @abstractmethod
    def take_failures(self) -> dict[int, str]:
        """Receives that failed before reaching the ranks (seq_id -> reason)."""

    @abstractmethod
    def request_finished(self, seq: Sequence) -> tuple[bool, dict | None]:
        """(hold the request's blocks for the peer, kv_transfer_params to return)."""

    @abstractmethod
    def abort(self, seq: Sequence) -> None:
        """A parked request ended before its receive: forget it, let the producer
        free its blocks."""

    @abstractmethod
    def lease_deadline(self) -> float:
        """Monotonic time until which a producer holds a finished request's blocks."""

    @abstractmethod
    def request_received(self, seq: Sequence, ok: bool) -> None:
        """The receive of `seq` ended; tell the producer it may free its blocks."""


class KVConnectorWorker(ABC):
    """Worker side (every rank)."""

    @abstractmethod
    def register_kv_caches(
        self, regions: list[Region], pp_rank: int, tp_rank: int
    ) -> RankLayout:
        """Register this rank's regions with the transfer engine."""

    @abstractmethod
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Start this step's receives into this rank's regions."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Receives that ended since the last call."""
