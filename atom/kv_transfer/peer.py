"""The side channel to a producer: its layout (`GET /kv_transfer_info`) and the
release of a transfer (`POST /kv_transfer/release`), over the producer's own HTTP
server, with a timeout so that a dead peer fails the receive instead of hanging."""

from __future__ import annotations

import httpx

from atom.kv_transfer.regions import EngineLayout

INFO_PATH = "/kv_transfer_info"
RELEASE_PATH = "/kv_transfer/release"


class PeerError(RuntimeError):
    """The producer could not be reached or refused."""


class HttpPeer:
    """The producers a consumer talks to, each named by its server's URL."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def layout(self, url: str) -> EngineLayout:
        try:
            reply = httpx.get(url.rstrip("/") + INFO_PATH, timeout=self.timeout_s)
            reply.raise_for_status()
            info = reply.json()
        except (httpx.HTTPError, ValueError) as error:
            raise PeerError(f"producer {url} gave no layout: {error}") from None
        if info.get("kv_role") != "kv_producer" or "layout" not in info:
            role = info.get("kv_role")
            raise PeerError(f"{url} is not a P/D producer (kv_role {role})")
        return EngineLayout.from_dict(info["layout"])

    def release(self, url: str, transfer_id: int) -> None:
        try:
            reply = httpx.post(
                url.rstrip("/") + RELEASE_PATH,
                json={"transfer_id": transfer_id},
                timeout=self.timeout_s,
            )
            reply.raise_for_status()
        except httpx.HTTPError as error:
            raise PeerError(f"producer {url} took no release: {error}") from None
