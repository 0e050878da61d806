"""Tensor- and pipeline-parallel process groups over torch.distributed.

Global rank = pp_rank * tp + tp_rank: a stage is one contiguous TP group, and the PP
group of TP rank i links rank i of every stage. Without `init_distributed` both groups
are single-rank, so models build and run in one process.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from atom.distributed.node_layout import NodeLayout
from atom.distributed.node_rendezvous import world_store
from atom.distributed.rank_process import loopback_store, use_loopback_sockets


class GroupCoordinator:
    """One process group seen from one of its ranks."""

    def __init__(
        self,
        ranks: list[int],
        rank: int,
        device_group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
        name: str = "group",
    ) -> None:
        self.ranks = ranks
        self.rank = rank
        self.rank_in_group = ranks.index(rank)
        self.world_size = len(ranks)
        self.device_group = device_group
        self.cpu_group = cpu_group if cpu_group is not None else device_group
        self.name = name

    def __repr__(self) -> str:
        return f"{self.name}(rank {self.rank_in_group} of {self.world_size})"

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def _require_group(self, op: str) -> None:
        if self.device_group is None:
            raise RuntimeError(
                f"{op} on {self!r}: this group is structural only "
                "(built for placement, no processes behind it)"
            )

    def _comm_view(self, tensor: torch.Tensor) -> torch.Tensor:
        # Ranks sharing one GPU talk over gloo, which wants host tensors.
        if tensor.is_cuda and dist.get_backend(self.device_group) == "gloo":
            return tensor.cpu()
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        self._require_group("all_reduce")
        buf = self._comm_view(tensor)
        dist.all_reduce(buf, group=self.device_group)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        self._require_group("all_gather")
        buf = self._comm_view(tensor.contiguous())
        parts = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(parts, buf, group=self.device_group)
        return torch.cat(parts, dim=dim).to(tensor.device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        self._require_group("broadcast")
        buf = self._comm_view(tensor)
        dist.broadcast(buf, src=self.ranks[src], group=self.device_group)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        if self.world_size == 1:
            return obj
        self._require_group("broadcast_object")
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def send_object(self, obj: object, dst: int) -> None:
        """Send a picklable object to global rank `dst` over the CPU group."""
        self._require_group("send_object")
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()], dtype=torch.long), dst, self.cpu_group)
        dist.send(data, dst, self.cpu_group)

    def recv_object(self, src: int) -> object:
        self._require_group("recv_object")
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, src, self.cpu_group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src, self.cpu_group)
        return pickle.loads(data.numpy().tobytes())

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._require_group("send")
        dist.send(self._comm_view(tensor.contiguous()), dst, self.device_group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._require_group("recv")
        buf = self._comm_view(tensor)
        dist.recv(buf, src, self.device_group)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            self._require_group("barrier")
            dist.barrier(group=self.cpu_group)


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else GroupCoordinator([0], 0, name="tp")


def get_pp_group() -> GroupCoordinator:
    return _PP if _PP is not None else GroupCoordinator([0], 0, name="pp")


def stage_ranks(tp_size: int, pp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(TP groups, PP groups) as lists of global ranks."""
    tp_groups = [[p * tp_size + t for t in range(tp_size)] for p in range(pp_size)]
    pp_groups = [[p * tp_size + t for p in range(pp_size)] for t in range(tp_size)]
    return tp_groups, pp_groups


def init_distributed(
    tp_size: int,
    pp_size: int,
    rank: int,
    backend: str,
    master_port: int,
    nodes: NodeLayout | None = None,
) -> None:
    """Join the world and build this rank's TP and PP groups (every rank calls this).

    On one machine rank 0 serves the rendezvous store on loopback `master_port`,
    and gloo / NCCL sockets stay on loopback too. Across `nodes`, every rank is a
    client of node 0's store, and the sockets use the interface the node process
    chose (dist_interface.py).
    """
    global _TP, _PP
    world = tp_size * pp_size
    if nodes is not None and nodes.is_multinode:
        store = world_store(nodes)
    else:
        use_loopback_sockets()
        store = loopback_store(rank, world, master_port)
    dist.init_process_group(backend, store=store, world_size=world, rank=rank)
    _TP, _PP = _new_groups(tp_size, pp_size, rank, backend)


def _new_groups(
    tp_size: int, pp_size: int, rank: int, backend: str
) -> tuple[GroupCoordinator | None, GroupCoordinator | None]:
    """(TP, PP) coordinators of `rank` for a tp x pp layout of global ranks
    0..tp*pp-1; None for a rank outside it. Every rank of the world must call this:
    creating a group is collective."""
    mine: dict[str, GroupCoordinator] = {}
    tp_groups, pp_groups = stage_ranks(tp_size, pp_size)
    for kind, groups in (("tp", tp_groups), ("pp", pp_groups)):
        for ranks in groups:
            device_group = dist.new_group(ranks, backend=backend)
            cpu_group = (
                device_group
                if backend == "gloo"
                else dist.new_group(ranks, backend="gloo")
            )
            if rank in ranks:
                mine[kind] = GroupCoordinator(
                    ranks, rank, device_group, cpu_group, kind
                )
    return mine.get("tp"), mine.get("pp")


def destroy_distributed() -> None:
    global _TP, _PP
    _TP = _PP = None
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def build_parallel_state(
    tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1
) -> Iterator[None]:
    """Install structural groups so one process can build any rank's modules.

    For placement tests: shapes and PPMissingLayers follow the given ranks; any
    collective on a multi-rank structural group raises instead of pretending.
    """
    global _TP, _PP
    saved = (_TP, _PP)
    tp_groups, pp_groups = stage_ranks(tp_size, pp_size)
    rank = pp_rank * tp_size + tp_rank
    _TP = GroupCoordinator(tp_groups[pp_rank], rank, name="tp")
    _PP = GroupCoordinator(pp_groups[tp_rank], rank, name="pp")
    try:
        yield
    finally:
        _TP, _PP = saved


@contextmanager
def layout_parallel_state(tp_size: int, pp_size: int) -> Iterator[bool]:
    """Inside an initialised world: real TP and PP groups for a tp x pp layout of its
    first tp * pp ranks, so one set of processes can run several layouts in turn.

    Every rank of the world enters (creating groups is collective) and learns whether
    it belongs to the layout; on exit all ranks meet again and the world's own groups
    are back.
    """
    global _TP, _PP
    world = dist.get_world_size()
    if tp_size * pp_size > world:
        raise ValueError(
            f"a {tp_size} x {pp_size} layout needs {tp_size * pp_size} ranks, the "
            f"world has {world}"
        )
    saved = (_TP, _PP)
    tp, pp = _new_groups(tp_size, pp_size, dist.get_rank(), dist.get_backend())
    member = tp is not None
    if member:
        _TP, _PP = tp, pp
    try:
        yield member
    finally:
        _TP, _PP = saved
        dist.barrier()
