"""This node's membership of a multi-node world: joining it and noticing its end.

Joining is the rendezvous of node_rendezvous.py. After it, every node bumps a
heartbeat counter in the store each second and watches its peers' counters (node
0 watches every node, the others watch node 0). Counters instead of timestamps, so
unsynchronised clocks do not matter. A peer is lost when its counter stands still
for --node-timeout seconds, when it posts a failure, or (for the other nodes) when
node 0's store can no longer be reached, which is at once when node 0's process
ends. Faster signals (a rank's broken socket) are passed in with `note_lost`.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from atom.config import Config
from atom.distributed.node_rendezvous import (
    connect_store,
    error_line,
    meet_as_head,
    meet_as_member,
    node_store,
)

logger = logging.getLogger(__name__)

BEAT_S = 1.0
# Settings every rank must share: they size the caches and state slots, split the
# layers and shape each step, and every node's ranks build from their own node's.
RANK_SETTINGS = (
    "device",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_kvcache_blocks",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "kv_role",
    "kv_transfer_config",
    "pp_layer_partition",
    "method",
    "num_speculative_tokens",
)


class NodeMembership:
    """Join at construction (raises NodeLayoutError on a refusal), then watch."""

    def __init__(self, config: Config, backend: str, model: dict) -> None:
        """`backend`: the one this node's ranks will use; `model`: the fingerprint
        of what they will load (`model_loader/model_fingerprint.py`); all nodes
        must agree on both."""
        self.layout = layout = config.node_layout
        for line in layout.placement_lines():
            logger.info("placement: %s", line)
        host = layout.node_rank == 0 and not layout.store_hosted_elsewhere
        # Kept for the life of this object: on node 0 it is the server itself.
        self._server = connect_store(layout, layout.join_timeout, host)
        store = node_store(self._server)
        facts = {
            **layout.facts(),
            "backend": backend,
            "settings": {name: getattr(config, name) for name in RANK_SETTINGS},
            "model": model,
        }
        if layout.node_rank == 0:
            meet_as_head(store, layout, facts)
        else:
            meet_as_member(store, layout, facts)
        logger.info(
            "node %d of %d joined at %s:%d",
            layout.node_rank,
            layout.nnodes,
            layout.master_addr,
            layout.master_port,
        )
        self._store = store
        self._lock = threading.Lock()
        self._lost: str | None = None
        watched = range(1, layout.nnodes) if layout.node_rank == 0 else [0]
        now = time.monotonic()
        self._beats = {node: (-1, now) for node in watched}
        self._stop = threading.Event()
        self._beater = threading.Thread(
            target=self._beat,
            args=(self._client(),),
            name="atom-node-beat",
            daemon=True,
        )
        self._beater.start()

    def _client(self) -> dist.Store:
        # A store client per thread: one client is not meant to be shared.
        layout = self.layout
        return node_store(connect_store(layout, layout.join_timeout, host=False))

    def _beat(self, store: dist.Store) -> None:
        key = f"beat/{self.layout.node_rank}"
        while not self._stop.is_set():
            try:
                store.add(key, 1)
            except Exception as error:  # the store is gone: lost() says so
                logger.debug("heartbeat stopped: %s", error)
                return
            self._stop.wait(BEAT_S)

    def note_lost(self, reason: str) -> None:
        """Record a loss seen elsewhere (the first reason is kept)."""
        with self._lock:
            self._lost = self._lost or reason

    def lost(self) -> str | None:
        """Why the world cannot go on, or None while every watched node lives."""
        with self._lock:
            if self._lost is None:
                self._lost = self._look()
            return self._lost

    def _look(self) -> str | None:
        try:
            for node, (count, since) in self._beats.items():
                if self._store.check([f"failed/{node}"]):
                    reason = self._store.get(f"failed/{node}").decode()
                    return f"node {node} failed: {reason}"
                now = time.monotonic()
                beat = self._store.add(f"beat/{node}", 0)
                if beat != count:
                    self._beats[node] = (beat, now)
                elif now - since > self.layout.node_timeout:
                    return (
                        f"node {node} sent no heartbeat for "
                        f"{self.layout.node_timeout:.0f} s (--node-timeout)"
                    )
        except Exception as error:
            return (
                f"lost node 0's rendezvous store at {self.layout.master_addr}:"
                f"{self.layout.master_port} ({error_line(error)})"
            )
        return None

    def report_failure(self, reason: str) -> None:
        """Tell the other nodes why this one stops (best effort: the store may be
        gone already)."""
        try:
            self._store.set(f"failed/{self.layout.node_rank}", reason)
        except Exception as error:
            logger.debug("could not post the failure: %s", error)

    def close(self) -> None:
        self._stop.set()
        self._beater.join(timeout=2 * BEAT_S)
