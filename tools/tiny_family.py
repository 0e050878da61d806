"""What `tools.train_tiny` trains for each model family: its targets (one stage each)
and the DSpark draft distilled from one of them, with the folder writers that give
training and evaluation the layouts the builders ship."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from atom.models.tiny import build, minimax

Writer = Callable[[Path, dict[str, torch.Tensor]], None]


@dataclass(frozen=True)
class Target:
    name: str  # the trained file (atom/models/tiny/trained.py)
    write: Writer


@dataclass(frozen=True)
class Family:
    targets: dict[str, Target]  # stage -> target, in training order
    draft: str  # the draft's trained file
    draft_target: str  # the stage whose target the draft is distilled from
    write_draft: Writer  # without the embedding copy: atom never loads it

    @property
    def stages(self) -> tuple[str, ...]:
        return (*self.targets, "draft")

    @property
    def trained_files(self) -> tuple[str, ...]:
        return (*(t.name for t in self.targets.values()), self.draft)


FAMILIES: dict[str, Family] = {
    "kimi": Family(
        targets={
            "k3": Target(
                "tiny-kimi-k3",
                lambda out, tensors: build.write_k3_layout(out, build.K3_ARCH, tensors),
            ),
            "linear": Target("tiny-kimi-linear", build.write_kimi_linear),
        },
        draft="tiny-kimi-k3-dspark",
        draft_target="k3",
        write_draft=partial(build.write_dspark_draft, embedding=None),
    ),
    "minimax": Family(
        targets={
            "m3": Target(
                "tiny-minimax-m3",
                lambda out, t: minimax.write_minimax(out, minimax.M3_ARCH, t),
            )
        },
        draft="tiny-minimax-m3-dspark",
        draft_target="m3",
        write_draft=partial(minimax.write_minimax_dspark, embedding=None),
    ),
}
