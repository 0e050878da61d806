"""A rank's caches as named regions, and the layout both sides of P/D must share.

Regions are matched by name, never by position, so a producer split into pipeline
stages serves a consumer that is not: each stage owns the names of its own layers.

- `mla.L{n}` (Kimi's MLA; `attn.L{n}` for MiniMax's attention): target decoder
  layer n's paged KV rows, one unit per block;
- `draft.mla.{i}` (`draft.attn.{i}` for the Qwen3 draft): the DSpark draft's layer
  i context KV rows, one unit per block;
- `kda.L{n}.conv`, `kda.L{n}.recurrent`: layer n's committed KDA state, one unit
  per state slot (the per-row verify snapshots stay behind).

The fingerprint hashes what both sides must agree on (names, unit sizes, dtypes,
the block size), so a mismatch is refused at the handshake with the difference
named instead of writing garbage into the other engine's caches.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from atom.models.interfaces import PagedKVLayer, RecurrentStateLayer

BLOCK, SLOT = "block", "slot"
# The DSpark draft's context rows: a consumer may leave them cold (`allow_cold_draft`).
DRAFT_PREFIX = "draft."
# The KDA state called `ssm` by the layer (models/kimi/kda.py) travels as `recurrent`.
STATE_REGION_NAMES = {"ssm": "recurrent"}
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class LayoutMismatch(ValueError):
    """The producer's and the consumer's caches are not laid out alike."""


@dataclass(frozen=True)
class Region:
    name: str
    base_addr: int
    unit_bytes: int
    num_units: int
    dtype: str
    # BLOCK: one unit per KV block; SLOT: one unit per KDA state slot.
    kind: str

    def addr(self, unit: int) -> int:
        if not 0 <= unit < self.num_units:
            raise ValueError(
                f"region {self.name}: unit {unit} outside [0, {self.num_units})"
            )
        return self.base_addr + unit * self.unit_bytes


@dataclass
class RankLayout:
    """One rank's regions and the transfer engine address that serves them."""

    pp_rank: int
    tp_rank: int
    address: str
    regions: list[Region] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RankLayout:
        regions = [Region(**r) for r in data["regions"]]
        return cls(data["pp_rank"], data["tp_rank"], data["address"], regions)


def _layer_index(qualified_name: str) -> int:
    found = _LAYER_INDEX.search(qualified_name)
    if found is None:
        raise ValueError(f"cache layer {qualified_name!r} has no `layers.N` index")
    return int(found.group(1))


def _kv_prefix(layer: nn.Module) -> str:
    # Attention layers name their kind (`kv_region_kind`); "kv" for any other.
    return getattr(layer, "kv_region_kind", "kv")


def _tensor_region(name: str, tensor: torch.Tensor, kind: str) -> Region:
    if not tensor.is_contiguous():
        raise ValueError(f"region {name}: its tensor is not contiguous")
    return Region(
        name=name,
        base_addr=tensor.data_ptr(),
        unit_bytes=tensor[0].nbytes,
        num_units=tensor.shape[0],
        dtype=str(tensor.dtype).removeprefix("torch."),
        kind=kind,
    )


def cache_regions(
    target: nn.Module,
    draft: nn.Module | None,
    states: dict[int, dict[str, torch.Tensor]],
) -> list[Region]:
    """The named regions of one rank's bound caches.

    `states` maps id(layer) to the committed state tensors CacheEngine allocated
    for each recurrent layer (`{state name: [slots, *shape]}`).
    """
    regions = []
    for qualified, layer in target.named_modules():
        if isinstance(layer, PagedKVLayer) and layer.kv_cache is not None:
            name = f"{_kv_prefix(layer)}.L{_layer_index(qualified)}"
            regions.append(_tensor_region(name, layer.kv_cache, BLOCK))
        elif isinstance(layer, RecurrentStateLayer) and id(layer) in states:
            index = _layer_index(qualified)
            for state_name, tensor in states[id(layer)].items():
                kind_name = STATE_REGION_NAMES.get(state_name, state_name)
                regions.append(
                    _tensor_region(f"kda.L{index}.{kind_name}", tensor, SLOT)
                )
    if draft is not None:
        for qualified, layer in draft.named_modules():
            if isinstance(layer, PagedKVLayer) and layer.kv_cache is not None:
                name = f"draft.{_kv_prefix(layer)}.{_layer_index(qualified)}"
                regions.append(_tensor_region(name, layer.kv_cache, BLOCK))
    return regions


def _signature(regions: list[Region]) -> dict[str, tuple[int, str, str]]:
    return {r.name: (r.unit_bytes, r.dtype, r.kind) for r in regions}


@dataclass
class EngineLayout:
    """Every rank's regions of one engine, and what the fingerprint covers."""

    block_size: int
    tp_size: int
    pp_size: int
    ranks: list[RankLayout]

    def regions_of_tp_rank(self, tp_rank: int) -> list[Region]:
        """All stages' regions of one TP rank: the whole model's layout."""
        return [
            r for rank in self.ranks if rank.tp_rank == tp_rank for r in rank.regions
        ]

    def fingerprint(self) -> str:
        signature = sorted(_signature(self.regions_of_tp_rank(0)).items())
        text = repr((self.block_size, self.tp_size, signature))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "fingerprint": self.fingerprint(),
            "ranks": [rank.to_dict() for rank in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: dict) -> EngineLayout:
        ranks = [RankLayout.from_dict(r) for r in data["ranks"]]
        layout = cls(data["block_size"], data["tp_size"], data["pp_size"], ranks)
        if data.get("fingerprint") not in (None, layout.fingerprint()):
            raise LayoutMismatch("the peer's layout does not match its fingerprint")
        return layout


def check_same_layout(
    local: EngineLayout, remote: EngineLayout, allow_cold_draft: bool = False
) -> None:
    """Raise LayoutMismatch naming every difference between the two layouts;
    `allow_cold_draft` forgives draft regions the remote side lacks."""
    if local.fingerprint() == remote.fingerprint():
        return
    problems = []
    if local.block_size != remote.block_size:
        problems.append(
            f"block size {local.block_size} here, {remote.block_size} there"
        )
    if local.tp_size != remote.tp_size:
        problems.append(
            f"tensor parallel size {local.tp_size} here, {remote.tp_size} there "
            "(P/D needs equal TP)"
        )
    mine = _signature(local.regions_of_tp_rank(0))
    theirs = _signature(remote.regions_of_tp_rank(0))
    only_here = sorted(set(mine) - set(theirs))
    if allow_cold_draft:
        only_here = [name for name in only_here if not name.startswith(DRAFT_PREFIX)]
    if only_here:
        problems.append(f"regions only here: {', '.join(only_here)}")
    if only_there := sorted(set(theirs) - set(mine)):
        problems.append(f"regions only on the peer: {', '.join(only_there)}")
    for name in sorted(set(mine) & set(theirs)):
        if mine[name] != theirs[name]:
            problems.append(
                f"{name}: (unit bytes, dtype, kind) {mine[name]} here, "
                f"{theirs[name]} there"
            )
    if problems:
        raise LayoutMismatch("KV layouts differ: " + "; ".join(problems))
