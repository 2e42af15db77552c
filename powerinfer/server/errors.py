"""Every failure answered with OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from powerinfer.api.schemas import validation_message
from powerinfer.errors import ContextOverflowError, PowerInferError
from powerinfer.logs import failure_text

log = logging.getLogger(__name__)


class APIError(Exception):
    """An answer other than 200, raised from a route."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_exception(error: Exception) -> APIError:
    """What to answer for an error raised while serving a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ContextOverflowError):
        return APIError(400, str(error), param="prompt", code="context_length_exceeded")
    if isinstance(error, PowerInferError):
        return APIError(400, str(error))
    log.error("internal error: %s", failure_text(error))
    return APIError(500, f"internal error: {type(error).__name__}", type="server_error")


def _respond(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.type, error.param, error.code), status_code=error.status)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(error.errors()))
        return _respond(APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _respond(APIError(error.status_code, str(error.detail), type=kind))

    @app.exception_handler(APIError)
    @app.exception_handler(PowerInferError)
    async def refused(_: Request, error: Exception) -> JSONResponse:
        return _respond(from_exception(error))

    @app.exception_handler(Exception)  # a bug: answered as a 500 with the same body, and logged
    async def any_error(_: Request, error: Exception) -> JSONResponse:
        return _respond(from_exception(error))
