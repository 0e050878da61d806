"""Per-stage parameter bytes by group, logged at start-up.

Makes the last stage's embedding copy (held for the DSpark drafter) visible: it costs
vocab/tp x hidden x dtype bytes there, and nothing where no sharing drafter runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.model_loader.loader import parameter_bytes
from atom.models.utils import language_model_of

if TYPE_CHECKING:
    from atom.spec_decode.drafter import Drafter

logger = logging.getLogger(__name__)


def memory_ledger(model: nn.Module, drafter: Drafter | None = None) -> dict[str, int]:
    lm = language_model_of(model)
    base = lm.model
    ledger = {
        "embedding": parameter_bytes(base.embed_tokens),
        "layers": parameter_bytes(base.layers),
        "lm_head": parameter_bytes(lm.lm_head),
    }
    ledger["other"] = parameter_bytes(model) - sum(ledger.values())
    # The draft's own weights; the embedding and LM head it shares are counted above.
    ledger["draft"] = parameter_bytes(drafter.model) if drafter is not None else 0
    return ledger


def log_memory_ledger(ledger: dict[str, int]) -> None:
    parts = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in ledger.items())
    logger.info(
        "[memory ledger pp_rank %d tp_rank %d] %s",
        get_pp_group().rank_in_group,
        get_tp_group().rank_in_group,
        parts,
    )
