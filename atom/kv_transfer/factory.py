"""Connectors by their `kv_connector` name (case-folded).

Each name maps to the module that implements it, imported only when an engine picks
it, so that checking a configuration (`Config`) loads no connector or model code.
A connector module defines `SchedulerConnector` and `WorkerConnector`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from atom.kv_transfer.config import KVTransferConfig

if TYPE_CHECKING:
    from atom.kv_transfer.connector import KVConnectorScheduler, KVConnectorWorker

CONNECTORS = {
    "mooncake": "atom.kv_transfer.mooncake_connector",
}


def check_connector_name(config: KVTransferConfig) -> str:
    """The module of the configured connector; ValueError naming the choices."""
    module = CONNECTORS.get(config.kv_connector.lower())
    if module is None:
        raise ValueError(
            f"kv_transfer_config kv_connector {config.kv_connector!r}; "
            f"allowed: {', '.join(CONNECTORS)}"
        )
    return module


def _module(config: KVTransferConfig) -> ModuleType:
    return importlib.import_module(check_connector_name(config))


def create_scheduler_connector(config: KVTransferConfig) -> KVConnectorScheduler:
    return _module(config).SchedulerConnector(config)


def create_worker_connector(config: KVTransferConfig) -> KVConnectorWorker:
    return _module(config).WorkerConnector(config)
