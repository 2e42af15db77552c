"""Runs inside Ray Serve's HTTP proxy (installed through RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH):
a request whose replica died is retried on a live one or answered cleanly, and the proxy's own
refusals get OpenAI's error shape.

What Ray's proxy does on its own (ray.serve._private.proxy): a replica that dies before answering
leaves the proxy's ASGI app returning without a response, so uvicorn writes a bare
"500 Internal Server Error"; a replica that dies in the middle of a stream leaves the body
unfinished; its own refusals (503 while no replica can take a request, 408, 429) are plain text.
"""

from __future__ import annotations

import json
import logging

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from powerinfer.server.errors import error_body
from powerinfer.server.generation import sse
from powerinfer.server.replica import REPLICA_HEADER

log = logging.getLogger(__name__)
RETRIES = 1  # a request no replica began to answer goes once more through Ray's router, which avoids the dead one
REPLAY_LIMIT_BYTES = 8 * 1024 * 1024  # bodies kept for a retry; a larger one is answered 503 instead
RETRY_AFTER_SECONDS = b"1"  # Ray restarts the replica; the others take requests at once
LOST_BEFORE = "the replica serving this request stopped before answering; the request can be retried"
LOST_DURING = "the replica serving this request stopped; the answer is incomplete"
PROXY_ERROR_TYPES = {404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error", 503: "unavailable_error"}


def proxy_middlewares() -> list[Middleware]:
    """The callback Ray's proxy calls at start (its import path goes in the environment variable)."""
    return [Middleware(ReplicaFailureAnswers)]


def _json_answer(status: int, message: str, type: str, headers: list[tuple[bytes, bytes]]) -> list[Message]:
    body = json.dumps(error_body(message, type)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    return [{"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False}]


class _Attempt:
    """One pass of a request through Ray's proxy: forwards what a replica answers, holds back an
    error the proxy itself answers (no replica header) to give it OpenAI's body, and remembers
    how far the answer got."""

    def __init__(self, send: Send):
        self.send = send
        self.started = self.finished = self.stream = False
        self.proxy_error: Message | None = None
        self.proxy_text = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = Headers(raw=message.get("headers", []))
            if REPLICA_HEADER not in headers and message["status"] >= 400:
                self.proxy_error = message
                return
            self.started = True
            self.stream = headers.get("content-type", "").startswith("text/event-stream")
        elif message["type"] == "http.response.body" and self.proxy_error is not None:
            self.proxy_text += message.get("body", b"")
            if not message.get("more_body", False):
                await self._rewrite()
            return
        elif message["type"] == "http.response.body":
            self.finished = not message.get("more_body", False)
        await self.send(message)

    async def _rewrite(self) -> None:
        assert self.proxy_error is not None
        status = self.proxy_error["status"]
        headers = [(k, v) for k, v in self.proxy_error.get("headers", [])
                   if k.lower() not in (b"content-type", b"content-length", b"transfer-encoding")]
        message = self.proxy_text.decode("utf-8", "replace").strip() or f"HTTP {status}"
        for out in _json_answer(status, message, PROXY_ERROR_TYPES.get(status, "server_error"), headers):
            await self.send(out)
        self.started = self.finished = True


class ReplicaFailureAnswers:
    """Wraps the proxy's ASGI app. A replica's answers (they carry REPLICA_HEADER) pass unchanged.
    A request that got no answer at all (its replica died first) is sent again, its body replayed;
    if that fails too, it gets a 503 with OpenAI's body. A stream whose replica died part-way ends
    with an error event, as the server's own streams end on a failure."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received: list[Message] = []  # the request's messages, for a replay
        size, disconnected = 0, False

        async def recording() -> Message:
            nonlocal size, disconnected
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                received.append(message)
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        for attempt in range(1 + RETRIES):
            answer = _Attempt(send)
            try:
                await self.app(scope, recording if attempt == 0 else _replay(list(received), receive), answer)
            except Exception:  # noqa: BLE001 - answered below like a replica lost before answering
                log.exception("Ray's proxy failed a request")
            if answer.started or disconnected or size > REPLAY_LIMIT_BYTES:
                break
            log.warning("a replica stopped before answering %s %s (attempt %d)", scope["method"], scope["path"], attempt + 1)
        if answer.finished or disconnected:
            return
        if not answer.started:
            for message in _json_answer(503, LOST_BEFORE, "unavailable_error", [(b"retry-after", RETRY_AFTER_SECONDS)]):
                await send(message)
        elif answer.stream:
            event = sse(error_body(LOST_DURING, "unavailable_error")).encode()
            await send({"type": "http.response.body", "body": event, "more_body": False})
        # A plain body cut short is left cut short: ending it would make a truncated JSON look whole.


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """The request's messages as first received, then the live connection (for its disconnect)."""

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return replay
