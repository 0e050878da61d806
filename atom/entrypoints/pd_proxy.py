"""The P/D router: an OpenAI-compatible server in front of one prefill (producer)
and one decode (consumer) server (docs/pd.md).

Each completion goes to the producer first, with `max_tokens: 1`, no streaming and
`kv_transfer_params: {"do_remote_decode": true}`; the producer prefills, samples
the first token and answers where its KV is. The router adds the producer's URL
(`remote_url`) and the producer's topology from its `/kv_transfer_info`, then sends
the original body with those params to the consumer and relays its answer,
streamed or not. An unreachable or failing producer or consumer is a 502 naming
which one, never a hang.

With an API key (`--api-key`, or `ATOM_API_KEY` as every atom server reads it) the
router requires it from its clients as the servers do (401 otherwise, /health open)
and presents it to both backends; without one it passes each client's
`Authorization` header on to them as it came.

    python -m atom.entrypoints.pd_proxy --prefill http://P:8100 \\
        --decode http://D:8200 --port 8000
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from atom.entrypoints.openai.request_guard import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    RequestGuard,
)
from atom.utils.api_key import api_key_from_env, bearer_headers
from atom.utils.log_format import configure_logging, uvicorn_log_config

logger = logging.getLogger(__name__)

# Prefill answers after one forward pass; decode streams for as long as it needs.
PREFILL_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0


def error(status: int, message: str, code: str) -> JSONResponse:
    body = {"error": {"message": message, "type": code, "code": status}}
    return JSONResponse(body, status_code=status)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the producer gets it: one token, no stream, hold the KV."""
    body = dict(body)
    body.pop("stream_options", None)
    body.update(
        stream=False,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def build_app(prefill_url: str, decode_url: str, api_key: str | None = None) -> FastAPI:
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    app = FastAPI(title="atom P/D proxy")
    if api_key:
        app.add_middleware(
            RequestGuard,
            max_body_bytes=DEFAULT_MAX_REQUEST_BODY_BYTES,
            api_key=api_key,
        )

    def backend_headers(request: Request) -> dict[str, str]:
        """What the backends are shown: the router's key, else the client's."""
        if api_key:
            return bearer_headers(api_key)
        presented = request.headers.get("authorization")
        return {"Authorization": presented} if presented else {}

    timeout = httpx.Timeout(PREFILL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    client = httpx.AsyncClient(timeout=timeout)
    producer_info: dict[str, Any] = {}

    async def producer_topology(headers: dict[str, str]) -> dict[str, Any]:
        if not producer_info:
            reply = await client.get(prefill_url + "/kv_transfer_info", headers=headers)
            reply.raise_for_status()
            info = reply.json()
            if info.get("kv_role") != "kv_producer":
                raise ValueError(
                    f"prefill server {prefill_url} is not a producer "
                    f"(kv_role {info.get('kv_role')!r})"
                )
            producer_info.update(info)
        return producer_info

    def prefill_failed(failure: Exception) -> JSONResponse:
        logger.error("prefill %s failed: %s", prefill_url, failure)
        return error(
            502, f"prefill server {prefill_url}: {failure}", "prefill_unreachable"
        )

    async def relay(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, "body must be a JSON object", "invalid_request_error")
        headers = backend_headers(request)
        try:
            info = await producer_topology(headers)
            reply = await client.post(
                prefill_url + path, json=prefill_body(body), headers=headers
            )
        except httpx.HTTPStatusError as failure:
            if failure.response.status_code == 401:  # the key, refused: the client's
                return Response(
                    failure.response.content, 401, media_type="application/json"
                )
            return prefill_failed(failure)
        except (httpx.HTTPError, ValueError) as failure:
            return prefill_failed(failure)
        if reply.status_code != 200:
            # The producer's own 4xx (a bad request) goes back as it came.
            return Response(
                reply.content, reply.status_code, media_type="application/json"
            )
        params = reply.json().get("kv_transfer_params")
        if not params:
            return error(
                502,
                f"prefill server {prefill_url} returned no kv_transfer_params",
                "prefill_missing_kv_transfer_params",
            )
        params = {
            **params,
            "remote_url": prefill_url,
            "remote_tp_size": info["tp_size"],
            "remote_dp_size": info.get("dp_size", 1),
            "remote_dp_rank": 0,
        }
        decode = {**body, "kv_transfer_params": params}
        if body.get("stream"):
            return await stream_decode(path, decode, headers)
        try:
            reply = await client.post(decode_url + path, json=decode, headers=headers)
        except httpx.HTTPError as failure:
            return error(
                502, f"decode server {decode_url}: {failure}", "decode_unreachable"
            )
        return Response(reply.content, reply.status_code, media_type="application/json")

    async def stream_decode(
        path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Response:
        upstream = client.build_request(
            "POST", decode_url + path, json=body, headers=headers
        )
        try:
            reply = await client.send(upstream, stream=True)
        except httpx.HTTPError as failure:
            return error(
                502, f"decode server {decode_url}: {failure}", "decode_unreachable"
            )
        if reply.status_code != 200:
            content = await reply.aread()
            await reply.aclose()
            return Response(content, reply.status_code, media_type="application/json")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            finally:
                await reply.aclose()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> Response:
        try:
            for url in (prefill_url, decode_url):
                (await client.get(url + "/health")).raise_for_status()
        except httpx.HTTPError as failure:
            return error(503, f"a backend is unhealthy: {failure}", "unhealthy")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        reply = await client.get(
            decode_url + "/v1/models", headers=backend_headers(request)
        )
        return Response(reply.content, reply.status_code, media_type="application/json")

    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="URL of the producer")
    parser.add_argument("--decode", required=True, help="URL of the consumer")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' from clients and present it to "
        "both backends (default: ATOM_API_KEY; unset: pass the clients' header on)",
    )
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)
    uvicorn.run(
        build_app(args.prefill, args.decode, args.api_key or api_key_from_env()),
        host=args.host,
        port=args.port,
        log_config=uvicorn_log_config(),
    )


if __name__ == "__main__":
    main()
