"""The side channel to a producer: its layout (`GET /kv_transfer_info`) and the
release of a transfer (`POST /kv_transfer/release`), over the producer's own HTTP
server, with a timeout so that a dead peer fails the receive instead of hanging.
Behind an API key the consumer presents the deployment's (`atom/utils/api_key.py`)."""

from __future__ import annotations

import httpx

from atom.kv_transfer.regions import EngineLayout
from atom.utils.api_key import API_KEY_ENV, bearer_headers

INFO_PATH = "/kv_transfer_info"
RELEASE_PATH = "/kv_transfer/release"


class PeerError(RuntimeError):
    """The producer could not be reached or refused."""


class HttpPeer:
    """The producers a consumer talks to, each named by its server's URL."""

    def __init__(self, timeout_s: float, api_key: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.headers = bearer_headers(api_key)

    def _check(self, url: str, reply: httpx.Response) -> None:
        if reply.status_code == 401:
            raise PeerError(
                f"producer {url} refused this consumer's API key: give both servers "
                f"the same key in {API_KEY_ENV}"
            )
        reply.raise_for_status()

    def layout(self, url: str) -> EngineLayout:
        try:
            reply = httpx.get(
                url.rstrip("/") + INFO_PATH,
                headers=self.headers,
                timeout=self.timeout_s,
            )
            self._check(url, reply)
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
                headers=self.headers,
                timeout=self.timeout_s,
            )
            self._check(url, reply)
        except httpx.HTTPError as error:
            raise PeerError(f"producer {url} took no release: {error}") from None
