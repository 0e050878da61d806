"""Writers of the tiny MiniMax-M3 folders: the target and its Qwen3-style DSpark drafts.

| name | layout | weights |
|---|---|---|
| tiny-minimax-m3 | released dialect, `language_model.*` + stub vision, one file | `trained/tiny-minimax-m3` |
| tiny-minimax-m31 | as M3, `MiniMaxM31SparseForConditionalGeneration` | `trained/tiny-minimax-m3` |
| tiny-minimax-m3-dspark | `Qwen3DSparkModel`, taps [1, 4], with a copy of the target's `embed_tokens` | `trained/tiny-minimax-m3-dspark` |
| tiny-minimax-m3-dspark-no-embed | the same draft without `embed_tokens` | `trained/tiny-minimax-m3-dspark` |

The layouts and what they exercise are described in `minimax_specs.py`; the weights
are a language model trained on the tiny corpus and a draft distilled from it
(`trained.py`, docs/tiny_models.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from atom.models.tiny.folder import save_tensors, write_common
from atom.models.tiny.minimax_specs import (
    TARGET_EMBED_NAME,
    draft_config,
    minimax_config,
)
from atom.models.tiny.trained import conform_to, trained_tensors

M3_ARCH = "MiniMaxM3SparseForConditionalGeneration"
M31_ARCH = "MiniMaxM31SparseForConditionalGeneration"
DRAFT_EMBED_NAME = "embed_tokens.weight"


def write_minimax(
    out_dir: str | Path, architecture: str, tensors: dict[str, torch.Tensor]
) -> None:
    out = Path(out_dir)
    config = minimax_config()
    config["architectures"] = [architecture]
    write_common(out, config)
    save_tensors(conform_to("tiny-minimax-m3", tensors), out / "model.safetensors")


def write_minimax_dspark(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    embedding: torch.Tensor | None,
) -> None:
    """A draft folder: its own tensors, plus `embed_tokens` when `embedding` is
    given (a copy of the target's table, which atom skips)."""
    out = Path(out_dir)
    write_common(out, draft_config())
    tensors = conform_to("tiny-minimax-m3-dspark", tensors)
    if embedding is not None:
        tensors[DRAFT_EMBED_NAME] = embedding.float().contiguous()
    save_tensors(tensors, out / "model.safetensors")


def build_minimax(out_dir: str | Path) -> None:
    write_minimax(out_dir, M3_ARCH, trained_tensors("tiny-minimax-m3"))


def build_minimax_m31(out_dir: str | Path) -> None:
    """The M3 weights under the M3.1 architecture name (served as a drop-in)."""
    write_minimax(out_dir, M31_ARCH, trained_tensors("tiny-minimax-m3"))


def build_minimax_dspark(out_dir: str | Path) -> None:
    """The draft distilled from tiny-minimax-m3, shipping a copy of its table."""
    embedding = trained_tensors("tiny-minimax-m3")[TARGET_EMBED_NAME]
    write_minimax_dspark(out_dir, trained_tensors("tiny-minimax-m3-dspark"), embedding)


def build_minimax_dspark_no_embed(out_dir: str | Path) -> None:
    write_minimax_dspark(out_dir, trained_tensors("tiny-minimax-m3-dspark"), None)


MINIMAX_BUILDERS: dict[str, Callable[[str | Path], None]] = {
    "tiny-minimax-m3": build_minimax,
    "tiny-minimax-m31": build_minimax_m31,
    "tiny-minimax-m3-dspark": build_minimax_dspark,
    "tiny-minimax-m3-dspark-no-embed": build_minimax_dspark_no_embed,
}
