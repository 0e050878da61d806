"""Which ranks run on which machine: the node-major placement of a pp x tp world.

Global rank = pp_rank * tp + tp_rank (parallel_state), and node n holds the
contiguous ranks n * L .. n * L + L - 1 with L = world / nnodes. When tp divides L,
a TP group never leaves its node and only pipeline sends cross the network: with
-pp 2 -tp 4 over two nodes, each stage is one node. A layout in which a TP group
would span nodes (tp does not divide L) is refused: its all-reduces would run over
the network on every layer.

torchrun's variables are read too, for clusters that start one `atom serve` per
node with `torchrun --nproc-per-node 1`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# torchrun sets this in every process it starts; it marks its variables as ours.
TORCHRUN_MARKER = "TORCHELASTIC_RUN_ID"
# torchrun's static rendezvous serves its own store on MASTER_PORT of node 0.
TORCHRUN_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


class NodeLayoutError(ValueError):
    """A multi-node layout that cannot run: refused before anything starts.

    Its message is one line meant for the user, so entry points print it without
    a traceback.
    """


@dataclass(frozen=True)
class NodeLayout:
    """One node's view of a world spread over `nnodes` machines."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # The network interface for gloo / NCCL sockets; None = the one that reaches
    # master_addr (dist_interface.py).
    dist_interface: str | None = None
    # Seconds every node may take to reach the rendezvous; a late one is named.
    join_timeout: float = 300.0
    # Seconds without a heartbeat after which a node counts as gone.
    node_timeout: float = 30.0
    # torchrun's agent already serves the store on master_port: connect, never host.
    store_hosted_elsewhere: bool = False

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise NodeLayoutError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise NodeLayoutError(
                f"--node-rank must lie in 0..{self.nnodes - 1} for --nnodes "
                f"{self.nnodes}, got {self.node_rank}"
            )
        for name in ("join_timeout", "node_timeout"):
            if getattr(self, name) <= 0:
                raise NodeLayoutError(
                    f"--{name.replace('_', '-')} must be > 0 seconds, "
                    f"got {getattr(self, name)}"
                )
        if self.nnodes == 1:
            return
        if not self.master_addr:
            raise NodeLayoutError(
                f"--nnodes {self.nnodes} needs --master-addr: the address of node 0 "
                "that every node can reach"
            )
        if self.master_port is None or not 0 < self.master_port < 65536:
            raise NodeLayoutError(
                f"--nnodes {self.nnodes} needs --master-port in 1..65535 (the same "
                f"on every node), got {self.master_port}"
            )
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        world = tp * pp
        if world % self.nnodes:
            raise NodeLayoutError(
                f"pp {pp} x tp {tp} = {world} ranks cannot be split evenly over "
                f"{self.nnodes} nodes (world size must be nnodes x ranks per node)"
            )
        if self.local_ranks % tp:
            raise NodeLayoutError(
                f"tp {tp} does not divide the {self.local_ranks} ranks of each node, "
                "so a TP group would span nodes; choose a tp that divides "
                f"pp x tp / nnodes = {self.local_ranks}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_multinode(self) -> bool:
        return self.nnodes > 1

    @property
    def local_ranks(self) -> int:
        """Ranks each node runs."""
        return self.world_size // self.nnodes

    def ranks_of(self, node: int) -> range:
        return range(node * self.local_ranks, (node + 1) * self.local_ranks)

    @property
    def my_ranks(self) -> range:
        return self.ranks_of(self.node_rank)

    @property
    def remote_ranks(self) -> list[int]:
        """Ranks outside node 0: they get their batches over the network."""
        return list(range(self.local_ranks, self.world_size))

    def node_of(self, rank: int) -> int:
        return rank // self.local_ranks

    def describe_rank(self, rank: int) -> str:
        tp = self.tensor_parallel_size
        where = f"pp_rank {rank // tp}, tp_rank {rank % tp}"
        if self.is_multinode:
            where += f", node {self.node_of(rank)}"
        return where

    def placement_lines(self) -> list[str]:
        """One line per node: its ranks and the stages they form."""
        tp = self.tensor_parallel_size
        lines = []
        for node in range(self.nnodes):
            ranks = self.ranks_of(node)
            stages = sorted({rank // tp for rank in ranks})
            stage_text = ", ".join(str(s) for s in stages)
            lines.append(
                f"node {node}: ranks {ranks.start}-{ranks.stop - 1} = pp stage"
                f"{'s' if len(stages) > 1 else ''} {stage_text} (tp {tp} each)"
            )
        return lines

    def facts(self) -> dict[str, int]:
        """What every node must agree on, compared at the rendezvous."""
        return {
            "nnodes": self.nnodes,
            "world_size": self.world_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
        }


def torchrun_settings(env: Mapping[str, str]) -> dict[str, object]:
    """nnodes, node_rank, master_addr and master_port from torchrun's variables
    ({} outside torchrun). atom starts the ranks of its node itself, so torchrun
    must start one process per node."""
    if TORCHRUN_MARKER not in env:
        return {}
    per_node = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if per_node != 1:
        raise NodeLayoutError(
            f"torchrun started {per_node} processes on this node; atom starts the "
            "ranks of a node itself: run torchrun with --nproc-per-node 1"
        )
    try:
        settings: dict[str, object] = {
            "nnodes": int(env["WORLD_SIZE"]),
            "node_rank": int(env.get("GROUP_RANK", env["RANK"])),
            "master_addr": env["MASTER_ADDR"],
            "master_port": int(env["MASTER_PORT"]),
        }
    except (KeyError, ValueError) as error:
        raise NodeLayoutError(
            f"torchrun variables incomplete or not integers: {error}"
        ) from None
    settings["store_hosted_elsewhere"] = env.get(TORCHRUN_AGENT_STORE) == "True"
    return settings
