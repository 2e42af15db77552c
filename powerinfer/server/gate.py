"""What every request passes before a route sees it: the Host allow-list (DNS rebinding), API keys,
a JSON content type on POST (a cross-site form or text/plain POST cannot reach us), a body-size
limit enforced while the body is read, chunked bodies included, a deadline for the whole body
(a client sending it a byte at a time), and a bound on the memory of all bodies being read at once.

Written as plain ASGI middleware because it must answer before the body is read (413 on a
Content-Length over the limit) and stop reading as soon as the limit is passed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from powerinfer.server.errors import error_body
from powerinfer.server.limits import DEFAULT_MAX_BODY_MEMORY, DEFAULT_MAX_BODY_SIZE, DEFAULT_READ_TIMEOUT

log = logging.getLogger(__name__)
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health"})  # answered without an API key (load balancers probe it)


def host_name(header: str) -> str:
    """The name in a Host header, without port or IPv6 brackets, lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def default_allowed_hosts(bind: str) -> frozenset[str] | None:
    """Loopback names when listening on a loopback address; None (any Host) otherwise."""
    name = host_name(bind) if bind.startswith("[") else bind.lower()
    if name in LOOPBACK_HOSTS or name.startswith("127."):
        return LOOPBACK_HOSTS | {name}
    return None


class BodyRefused(Exception):
    """A body not read to its end: the answer's status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class RequestGate:
    """ASGI middleware; see the module docstring. `allowed_hosts` None accepts any Host header;
    `body_timeout`: seconds for a whole body; `max_body_memory`: bytes of all bodies being read."""

    def __init__(self, app: ASGIApp, allowed_hosts: Collection[str] | None = None, api_keys: Collection[str] = (),
                 max_body_size: int = DEFAULT_MAX_BODY_SIZE, body_timeout: float = DEFAULT_READ_TIMEOUT,
                 max_body_memory: int = DEFAULT_MAX_BODY_MEMORY):
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_size, self.body_timeout, self.max_body_memory = max_body_size, body_timeout, max_body_memory
        self.body_memory = 0  # bytes of the bodies being read now (all on one event loop: no lock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _answer(send, *refusal)
            return
        if scope["method"] == "POST":
            try:
                body = await self._read_body(headers, receive)
            except BodyRefused as refusal:  # the rest of the body is not read: the connection closes
                log.warning("refused a request body from %s: %d %s", _client(scope), refusal.status, refusal.message)
                await _answer(send, refusal.status, refusal.message,
                              "unavailable_error" if refusal.status == 503 else "invalid_request_error", close=True)
                return
            receive = _replay(body, receive)  # decoded and parsed off the event loop: powerinfer/server/bodies.py
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str, str] | None:
        if self.allowed_hosts is not None:
            host = headers.get("host")
            if not host:
                return 400, "the request has no Host header", "invalid_request_error"
            if host_name(host) not in self.allowed_hosts:
                return 403, f"host {host_name(host)!r} is not allowed (the server's --allowed-hosts)", "permission_error"
        if self.api_keys and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            return 401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error"
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                return 415, "request bodies must be JSON, sent with 'Content-Type: application/json'", \
                    "invalid_request_error"
        return None

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
        # Every key is compared, in constant time each, so timing tells nothing about which matched.
        return sum(hmac.compare_digest(given, key) for key in self.api_keys) > 0

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The whole body; BodyRefused as soon as it passes the size limit (declared or as it
        arrives), its deadline, or the memory left for bodies being read."""
        too_large = BodyRefused(413, f"the request body is larger than {self.max_body_size} bytes "
                                     "(the server's --max-body-size)")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_size:
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left: the route sees an empty body
                        break
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    self.body_memory += len(chunk)
                    if size > self.max_body_size:
                        raise too_large
                    if self.body_memory > self.max_body_memory:
                        raise BodyRefused(503, "the server is reading too many request bodies at once; retry later "
                                               "(the server's --max-body-memory)")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise BodyRefused(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                   "(the server's --read-timeout)") from None
        finally:
            self.body_memory -= size
        return b"".join(chunks)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "an unknown client"


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that gives the body read already, then what the client sends next (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


async def _answer(send: Send, status: int, message: str, type: str, close: bool = False) -> None:
    """`close`: the connection closes after the answer (a body left unread must not keep it open)."""
    content = json.dumps(error_body(message, type)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                            *([(b"www-authenticate", b"Bearer")] if status == 401 else []),
                            *([(b"connection", b"close")] if close else [])]})
    await send({"type": "http.response.body", "body": content})
