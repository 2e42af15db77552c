"""Limits on connections, for uvicorn: how long a client may take to send a request's headers, how
long an idle keep-alive connection stays open, how many connections and requests are served at
once, and how large a header block may grow. (Bodies are timed and bounded by the request gate,
powerinfer/server/gate.py, which reads them.)

uvicorn has settings for all but the header deadline: a client that sends its headers a byte at
a time (slowloris) holds a connection for as long as it likes. `GuardedH11Protocol` adds that
deadline to uvicorn's h11 protocol.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from powerinfer.server.limits import DEFAULT_KEEP_ALIVE, DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT

MAX_HEADER_BYTES = 64 * 1024  # a request line and headers together (h11's default is 16 KiB)
# What a client that sent its headers too slowly gets, written raw: h11 will not send a response
# before it has read a request.
TIMEOUT_ANSWER = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    """`read_timeout`: seconds for a request's headers (from the connection's start, or the end of
    the previous answer on a kept-alive one); `keep_alive`: seconds an idle connection stays open;
    `max_connections`: connections (and requests in progress) beyond which requests get 503."""

    read_timeout: float = DEFAULT_READ_TIMEOUT
    keep_alive: float = DEFAULT_KEEP_ALIVE
    max_connections: int = DEFAULT_MAX_CONNECTIONS


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's header block."""

    header_timeout = DEFAULT_READ_TIMEOUT  # set per server by `server_config`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # h11 has a whole header block: the request started
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # kept alive: the next request's clock
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(TIMEOUT_ANSWER)
            self.transport.close()


def server_config(app: Any, limits: ConnectionLimits, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` under `limits` (`options`: uvicorn.Config's others)."""
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": limits.read_timeout})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.keep_alive,
                          limit_concurrency=limits.max_connections, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          **options)
