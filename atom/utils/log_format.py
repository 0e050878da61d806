"""One log format for every atom process: the server and its rank processes,
headless nodes and the P/D router, uvicorn's own loggers included.

A line reads `2026-12-04 21:40:43,117 INFO atom.model_engine.llm_engine: message`.
The level is `$ATOM_LOG_LEVEL` (default INFO) wherever the caller gives none.
"""

from __future__ import annotations

import logging
import os
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVEL_ENV = "ATOM_LOG_LEVEL"
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def configure_logging(level: str | int | None = None) -> None:
    """The root logger writes in LOG_FORMAT to stderr."""
    logging.basicConfig(
        level=level or os.environ.get(LOG_LEVEL_ENV, "INFO"), format=LOG_FORMAT
    )


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's `log_config`: its loggers keep their levels but hand every record
    to the root handler, so its lines (access lines too) read like atom's."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {
            name: {"handlers": [], "propagate": True} for name in _UVICORN_LOGGERS
        },
    }
