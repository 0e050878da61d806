"""The handshake's layout check and the merge of every rank's receive report."""

from __future__ import annotations

import pytest

from atom.kv_transfer.connector import KVConnectorOutput, merge_outputs
from atom.kv_transfer.regions import (
    BLOCK,
    SLOT,
    EngineLayout,
    LayoutMismatch,
    RankLayout,
    Region,
    check_same_layout,
)


def layout(block_size=16, tp=1, **unit_bytes: int) -> EngineLayout:
    """One rank per TP rank, its regions named by `unit_bytes` keys
    (`mla_L1=` -> `mla.L1`)."""
    regions = [
        Region(name.replace("_", "."), 4096 * i, size, 8, "float32",
               SLOT if name.startswith("kda") else BLOCK)
        for i, (name, size) in enumerate(unit_bytes.items())
    ]  # fmt: skip
    ranks = [RankLayout(0, r, f"127.0.0.1:{1000 + r}", regions) for r in range(tp)]
    return EngineLayout(block_size, tp, 1, ranks)


BASE = dict(mla_L1=2048, kda_L0_recurrent=16384, draft_mla_0=2048)


def test_equal_layouts_pass_and_survive_the_wire():
    mine = layout(**BASE)
    theirs = EngineLayout.from_dict(layout(**BASE).to_dict())
    check_same_layout(mine, theirs)
    assert mine.fingerprint() == theirs.fingerprint()


@pytest.mark.parametrize(
    "theirs, named",
    [
        (layout(block_size=32, **BASE), "block size 16 here, 32 there"),
        (layout(tp=2, **BASE), "tensor parallel size 1 here, 2 there"),
        (layout(**{**BASE, "mla_L1": 1024}), "mla.L1: (unit bytes, dtype, kind) (2048"),
        (layout(mla_L1=2048, kda_L0_recurrent=16384), "regions only here: draft.mla.0"),
        (layout(**BASE, mla_L3=2048), "regions only on the peer: mla.L3"),
    ],
)
def test_a_mismatch_is_refused_with_the_difference_named(theirs, named):
    with pytest.raises(LayoutMismatch, match="KV layouts differ") as refused:
        check_same_layout(layout(**BASE), theirs)
    assert named in str(refused.value)


def test_cold_draft_forgives_only_missing_draft_rows():
    no_draft = layout(mla_L1=2048, kda_L0_recurrent=16384)
    check_same_layout(layout(**BASE), no_draft, allow_cold_draft=True)
    with pytest.raises(LayoutMismatch, match="only here: mla.L1"):
        check_same_layout(layout(**BASE), layout(kda_L0_recurrent=16384,
                                                 draft_mla_0=2048),
                          allow_cold_draft=True)  # fmt: skip


def test_a_tampered_layout_is_refused():
    wire = layout(**BASE).to_dict()
    wire["ranks"][0]["regions"][0]["unit_bytes"] = 1
    with pytest.raises(LayoutMismatch, match="does not match its fingerprint"):
        EngineLayout.from_dict(wire)


def test_a_request_is_received_only_when_every_rank_received_it():
    ranks = [
        KVConnectorOutput({1, 2, 3}, {}),
        KVConnectorOutput({1, 3}, {2: "read failed"}),
        KVConnectorOutput({1, 2}, {}),
    ]
    merged = merge_outputs(ranks, {1, 2, 3})
    assert merged.finished_recving == {1}
    assert merged.failed_recving == {
        2: "read failed",
        3: "not every rank reported its receive",
    }
