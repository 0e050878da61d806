"""HTTP error answers: the OpenAI error body, and which status an exception gets."""

import logging

from fastapi.responses import JSONResponse

from atom.entrypoints.openai.async_engine import EngineDeadError
from atom.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, random_id

logger = logging.getLogger(__name__)


class APIError(Exception):
    """Answered as `{"error": {"message", "type", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def response(self) -> JSONResponse:
        info = ErrorInfo(message=self.message, type=self.kind, code=self.status)
        return JSONResponse(ErrorResponse(error=info).model_dump(), self.status)


def error_for(exc: BaseException) -> APIError:
    """Map an exception raised while serving a request to its HTTP error.

    An unexpected one is logged with its traceback under a fresh error id; the
    client gets that id in one line, never the traceback.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", "service_unavailable")
    if isinstance(exc, ValueError | TypeError):
        return APIError(400, str(exc))
    error_id = random_id("error")
    logger.error("request failed, error id %s", error_id, exc_info=exc)
    return APIError(
        500,
        f"internal error {error_id} ({type(exc).__name__}); the server log has details",
        "internal_error",
    )
