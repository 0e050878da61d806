"""Admission of HTTP requests before any route sees them: API key, then body size.

Both are judged from the headers first, so a refused client costs no body reading:
without the key every route but /health answers 401 (the API docs, /metrics and
/debug/* too, as they describe the server to whoever reads them; an unknown path
too, so that a 404 tells nothing about the routes), and a declared Content-Length
over the limit answers 413 at once. A body of undeclared length (chunked) is read
up to the limit and refused with 413 as soon as it passes it; a body within the
limit is handed to the route from memory. A client that leaves before the end of
its body is logged in one line and never reaches a route: there is no one left to
answer, and the route would only fail reading the body.
"""

import hmac
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from atom.entrypoints.openai.api_error import APIError

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
# The liveness probe of a load balancer or supervisor, which holds no key.
OPEN_PATHS = frozenset({"/health"})


class RequestGuard:
    """ASGI middleware: `max_body_bytes` for every request, `api_key` (if set) for
    every route but those of OPEN_PATHS."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.expected_key = api_key.encode() if api_key else None

    async def __call__(
        self, scope: MutableMapping[str, Any], receive: Receive, send: Send
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        body = self._refusal(scope["path"], headers) or await self._read_body(
            scope, receive
        )
        if body is None:
            return
        if isinstance(body, APIError):
            await self._answer(body, scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # later: the client's disconnect
            replayed = True
            return body

        await self.app(scope, replay, send)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        if self.expected_key is not None and path not in OPEN_PATHS:
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(
                key.strip(), self.expected_key
            ):
                return APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    "authentication_error",
                )
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return APIError(400, f"Content-Length {declared!r} is not a number")
            if int(declared) > self.max_body_bytes:
                return self._too_large()
        return None

    async def _read_body(
        self, scope: MutableMapping[str, Any], receive: Receive
    ) -> Message | APIError | None:
        """The whole body as one message, a refusal once it passes the limit, or
        None when the client left before the end of it."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                host, port = scope.get("client") or ("?", "?")
                logger.info(
                    "client %s:%s left during the upload of %s %s after %d body "
                    "bytes; nothing answered",
                    host,
                    port,
                    scope["method"],
                    scope["path"],
                    size,
                )
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                body = b"".join(chunks)
                return {"type": "http.request", "body": body, "more_body": False}

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body exceeds {self.max_body_bytes} bytes "
            "(the server's --max-request-body-bytes)",
        )

    @staticmethod
    async def _answer(
        error: APIError, scope: MutableMapping[str, Any], receive: Receive, send: Send
    ) -> None:
        response = error.response()
        # The unread body makes the connection unusable for another request.
        response.headers["connection"] = "close"
        if error.status == 401:
            response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)
