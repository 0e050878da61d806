"""`--kv-transfer-config`: the JSON object that makes an engine a P/D producer or
consumer, parsed once into `KVTransferConfig`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from atom.utils.json_flag import json_object

PD_ROLES = ("kv_producer", "kv_consumer")
# Transfer protocols the Mooncake connector passes to its engine: `tcp` moves host
# memory (CPU, or loopback tests), `rdma` registered GPU or host memory.
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_connector: str = "mooncake"
    protocol: str = "tcp"
    # The address this rank's transfer engine listens on and advertises.
    host: str = "127.0.0.1"
    # RDMA devices for Mooncake (`rdma` only); "" lets Mooncake choose.
    device_name: str = ""
    # A producer frees blocks the consumer never asked for after this long.
    kv_lease_timeout_s: float = 120.0
    # Longest wait for the producer's side channel (layout, release) on a consumer.
    peer_timeout_s: float = 10.0
    # Consumer: accept a producer without the draft's context rows and leave them
    # cold (output unchanged, acceptance lower); refused otherwise.
    allow_cold_draft: bool = False

    def __post_init__(self) -> None:
        if self.kv_role not in PD_ROLES:
            raise ValueError(
                f"kv_transfer_config kv_role {self.kv_role!r}; "
                f"allowed: {', '.join(PD_ROLES)}"
            )
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"kv_transfer_config protocol {self.protocol!r}; "
                f"allowed: {', '.join(PROTOCOLS)}"
            )
        if not isinstance(self.allow_cold_draft, bool):
            raise ValueError(
                "kv_transfer_config allow_cold_draft must be true or false, "
                f"got {self.allow_cold_draft!r}"
            )
        for name in ("kv_lease_timeout_s", "peer_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(
                    f"kv_transfer_config {name} must be a positive number of "
                    f"seconds, got {value!r}"
                )

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> KVTransferConfig:
        """From the flag's JSON text or an already decoded object."""
        value = json_object(
            value,
            "kv_transfer_config",
            '{"kv_role": "kv_producer", "kv_connector": "mooncake"}',
        )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"kv_transfer_config: unknown keys {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(known))}"
            )
        if "kv_role" not in value:
            raise ValueError(
                f"kv_transfer_config needs kv_role ({' or '.join(PD_ROLES)})"
            )
        return cls(**value)
