"""One log line per request, as llama-server and vLLM print them: method, route, status, tokens in
and out, milliseconds; as text or (`--log-format json`) as one JSON object a line.

The generations a request starts are noted through a context variable that this middleware sets
around the request (the handlers run in its context), so no handler has to pass them along."""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from powerinfer.server.generation import Generation

log = logging.getLogger("powerinfer.requests")
_generations: ContextVar[list[Generation] | None] = ContextVar("request_generations", default=None)
LogFormat = Literal["text", "json"]


def note_generation(generation: Generation) -> None:
    """Count `generation`'s tokens in the log line of the request being answered (if logged)."""
    started = _generations.get()
    if started is not None:
        started.append(generation)


class RequestLog:
    """ASGI middleware: logs each HTTP request once its answer has been sent (a stream's too)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        generations: list[Generation] = []
        token = _generations.set(generations)
        started, status = time.perf_counter(), [500]

        async def watched_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        finally:
            _generations.reset(token)
            sequences = [s for g in generations for s in g.request.sequences]
            log.info("request", extra={"request": {
                "method": scope["method"], "route": scope["path"], "status": status[0],
                "tokens_in": sum(len(g.sequence.prompt) for g in generations),
                "tokens_out": sum(len(s.generated) for s in sequences),
                "ms": round((time.perf_counter() - started) * 1e3, 1)}})


class _TextFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "request", None)
        if fields is None:
            return super().format(record)
        return (f"{fields['method']} {fields['route']} {fields['status']} in={fields['tokens_in']} "
                f"out={fields['tokens_out']} {fields['ms']:.1f} ms")


class _JSONFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "request", None) or {"message": record.getMessage()}
        return json.dumps({"time": round(record.created, 3), "level": record.levelname.lower(),
                           "logger": record.name, **fields})


def configure_logging(fmt: LogFormat) -> None:
    """Our request lines, and uvicorn's and our other logs in json mode, on stderr in `fmt`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JSONFormat() if fmt == "json" else _TextFormat("%(levelname)s:     %(message)s"))
    names = ["powerinfer.requests", *(["uvicorn", "uvicorn.error", "powerinfer"] if fmt == "json" else [])]
    for name in names:
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(logging.INFO)
