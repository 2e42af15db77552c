"""What an app that is one of several replicas behind a router adds to its answers: a header
naming the replica, and that name as a label on every /metrics series."""

from __future__ import annotations

import re

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REPLICA_HEADER = "x-powerinfer-replica"
REPLICA_LABEL = "replica"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{?)")  # a sample line's metric name, and its label brace


class ReplicaHeader:
    """Names the replica on every HTTP answer, errors and streams included."""

    def __init__(self, app: ASGIApp, name: str):
        self.app, self.name = app, name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REPLICA_HEADER] = self.name
            await send(message)

        await self.app(scope, receive, named)


def label_series(text: str, name: str, value: str) -> str:
    """Prometheus text with `name="value"` added to every sample. Done on the exposition text, so it
    holds whichever way the series were produced; the format allows a trailing comma in braces."""
    escaped = value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")
    label = f'{name}="{escaped}"'

    def relabel(line: str) -> str:
        match = _SAMPLE.match(line)
        if line.startswith("#") or match is None:
            return line
        metric, brace = match.groups()
        return f"{metric}{{{label}{',' if brace else '}'}{line[match.end():]}"

    return "\n".join(relabel(line) for line in text.split("\n"))
