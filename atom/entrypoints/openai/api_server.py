"""OpenAI-compatible HTTP server: the app factory, its flags, and `main()`."""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from atom.distributed.node_layout import NodeLayoutError
from atom.entrypoints.openai.api_error import APIError, error_for
from atom.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError
from atom.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics, StatsLogger
from atom.entrypoints.openai.protocol import ModelCard, ModelList
from atom.entrypoints.openai.request_guard import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    RequestGuard,
)
from atom.entrypoints.openai.serving import OpenAIServing
from atom.model_engine.arg_utils import EngineArgs
from atom.utils.api_key import API_KEY_ENV, api_key_from_env
from atom.utils.arg_parser import FlexibleArgumentParser, positive_int
from atom.utils.clean_exit import exit_cleanly
from atom.utils.log_format import configure_logging, uvicorn_log_config

logger = logging.getLogger(__name__)

# On SIGTERM, requests still streaming after this long are cut (and aborted) so
# that a stuck client cannot keep the server from exiting.
GRACEFUL_SHUTDOWN_S = 10
# Enough for a prompt of a million token ids; a larger body is refused (413).


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str | None = None,
    chat_template: str | None = None,
    default_chat_template_kwargs: dict[str, Any] | None = None,
    stats_log_interval_s: float = 10.0,
    server_info: dict[str, Any] | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app around an already started `AsyncEngine`.

    `api_key` (if set) is required as `Authorization: Bearer <key>` on every route
    but /health.
    """
    served_model_name = served_model_name or async_engine.model_name
    server_metrics = ServerMetrics(served_model_name)
    serving = OpenAIServing(
        async_engine,
        served_model_name,
        server_metrics,
        chat_template,
        default_chat_template_kwargs,
    )
    stats_logger = StatsLogger(async_engine, stats_log_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None
        if stats_log_interval_s > 0:
            task = asyncio.create_task(stats_logger.run())
        yield
        if task is not None:
            task.cancel()
        # The cumulative MTP line is what CI reads, so end on a fresh one.
        await stats_logger.log_once()

    app = FastAPI(title="atom", lifespan=lifespan)
    app.add_middleware(
        RequestGuard, max_body_bytes=max_request_body_bytes, api_key=api_key
    )

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own 404 / 405, answered in the shape of every other error.
        if exc.status_code == 404:
            error = APIError(
                404, f"no route {request.method} {request.url.path}", "not_found_error"
            )
        elif exc.status_code == 405:
            error = APIError(405, f"{request.url.path} does not serve {request.method}")
        else:
            error = APIError(exc.status_code, str(exc.detail))
        response = error.response()
        response.headers.update(exc.headers or {})  # e.g. 405's Allow
        return response

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return error_for(exc).response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request)

    def model_card() -> ModelCard:
        return ModelCard(
            id=served_model_name,
            root=async_engine.model_name,
            max_model_len=async_engine.max_model_len,
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    # `:path`, as served ids may hold slashes (`org/model`, a local directory).
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != served_model_name:
            raise APIError(
                404,
                f"model {model_id!r} does not exist; this server serves "
                f"{served_model_name!r}",
                "not_found_error",
            )
        return JSONResponse(model_card().model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.is_healthy:
            return JSONResponse({"status": "ok"})
        reason = async_engine.dead_reason or "engine thread stopped"
        return JSONResponse({"status": "unhealthy", "reason": reason}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats, speculation = await async_engine.call(
                lambda engine: (engine.get_stats(), engine.get_spec_decode_stats())
            )
        except EngineDeadError as error:
            return error_for(error).response()
        text = server_metrics.exposition(stats, speculation)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/debug/mtp_stats")
    async def mtp_stats() -> JSONResponse:
        try:
            speculation = await async_engine.call(
                lambda engine: engine.get_spec_decode_stats()
            )
        except EngineDeadError as error:
            return error_for(error).response()
        if speculation is None:
            return JSONResponse({"enabled": False})
        return JSONResponse({"enabled": True, **speculation})

    @app.get("/kv_transfer_info")
    async def kv_transfer_info() -> JSONResponse:
        try:
            info = await async_engine.call(lambda engine: engine.kv_transfer_info())
        except EngineDeadError as error:
            return error_for(error).response()
        return JSONResponse(info)

    @app.post("/kv_transfer/release")
    async def kv_transfer_release(request: Request) -> JSONResponse:
        """A consumer has pulled a transfer's blocks (or given up on them)."""
        try:
            transfer_id = (await request.json())["transfer_id"]
        except (ValueError, KeyError, TypeError):
            raise APIError(400, 'body must be {"transfer_id": <int>}') from None
        if not isinstance(transfer_id, int) or isinstance(transfer_id, bool):
            raise APIError(400, f"transfer_id must be an integer, got {transfer_id!r}")
        try:
            released = await async_engine.call(
                lambda engine: engine.release_kv_transfer(transfer_id)
            )
        except EngineDeadError as error:
            return error_for(error).response()
        return JSONResponse({"released": released})

    @app.get("/server_info")
    async def info() -> JSONResponse:
        return JSONResponse(
            {
                "model": async_engine.model_name,
                "served_model_name": served_model_name,
                "max_model_len": async_engine.max_model_len,
                "healthy": async_engine.is_healthy,
                **(server_info or {}),
            }
        )

    return app


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"invalid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_server_args(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    """Server flags followed by every engine flag."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; the default serves this machine only, "
        "0.0.0.0 serves every interface",
    )
    parser.add_argument("--server-port", type=int, default=8000, help="HTTP port")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' on every route but /health "
        f"(401 otherwise), /metrics and /docs included; None = the {API_KEY_ENV} "
        "environment variable, and no key at all when that is unset too",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are refused with 413 before they are read",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send; None = the --model value",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template: a file path or the template itself",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        help="JSON object passed to the chat template; a request's own wins",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        help="seconds an idle keep-alive connection stays open",
    )
    parser.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="do not log one line per HTTP request",
    )
    parser.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between engine stats log lines; 0 turns them off",
    )
    parser.add_argument(
        "--headless",
        action="store_true",
        help="a node other than 0 (--node-rank >= 1): run this node's ranks only, "
        "no engine and no HTTP server",
    )
    parser.add_unsupported_argument("--request-log")
    return EngineArgs.add_cli_args(parser)


def load_chat_template(value: str | None) -> str | None:
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as file:
        return file.read()


def run_server(args: argparse.Namespace) -> None:
    """Serve until SIGTERM / Ctrl-C (exit 0) or until the engine dies (exit 1, so
    that a supervisor restarts the server)."""
    # Imported here: a headless node needs the rank modules, parsing flags does not.
    from atom.entrypoints.headless import run_headless, runs_headless

    if runs_headless(args):
        run_headless(args)
        return
    # uvicorn shuts down gracefully on SIGTERM and then re-raises the signal; as
    # SystemExit it unwinds through the `finally` below, which closes the engine
    # (and its worker processes) instead of dying with them still running.
    signal.signal(signal.SIGTERM, exit_cleanly)
    configure_logging(logging.INFO)
    engine_args = EngineArgs.from_cli_args(args)
    logger.info("starting engine: %s", engine_args)
    server: uvicorn.Server | None = None

    def stop_serving(reason: str) -> None:
        logger.error("the engine died (%s); the server stops", reason)
        if server is not None:
            server.should_exit = True  # uvicorn polls it; safe from any thread

    async_engine = AsyncEngine(engine_args.create_engine, on_dead=stop_serving)
    try:
        async_engine.start()
    except NodeLayoutError as error:  # a refusal, not a crash: one line
        raise SystemExit(f"atom serve: error: {error}") from None
    try:
        app = build_app(
            async_engine,
            served_model_name=args.served_model_name or engine_args.model,
            chat_template=load_chat_template(args.chat_template),
            default_chat_template_kwargs=args.default_chat_template_kwargs,
            stats_log_interval_s=args.log_stats_interval,
            server_info={"engine_args": engine_args.engine_kwargs()},
            max_request_body_bytes=args.max_request_body_bytes,
            api_key=args.api_key or api_key_from_env(),
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.server_port,
            timeout_keep_alive=args.timeout_keep_alive,
            access_log=not args.disable_uvicorn_access_log,
            log_level="info",
            log_config=uvicorn_log_config(),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = uvicorn.Server(config)
        if async_engine.is_healthy:  # else it died before `server` was set
            server.run()
        if async_engine.dead_reason is not None:
            raise SystemExit(f"atom: the engine died: {async_engine.dead_reason}")
        if not server.started:
            raise SystemExit("atom: the HTTP server could not start (see above)")
    finally:
        async_engine.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    parser = add_server_args(
        FlexibleArgumentParser(description="atom OpenAI-compatible server")
    )
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn already logged
        run_server(args)


if __name__ == "__main__":
    main()
