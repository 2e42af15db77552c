"""One request's path from the scheduler's worker thread to an async route handler."""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HTTPRequest

from powerinfer.runtime.scheduler import Event, Request, Scheduler, SlicedCall
from powerinfer.runtime.sequence import Completion, GenerationSequence
from powerinfer.server.errors import error_body, from_exception


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before the answer was ready."""


class Mailbox:
    """Events from the scheduler's thread for the queues of one event loop: the scheduler puts a
    decode step's events (one per row), then wakes the loop once for all of them."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: deque[tuple[asyncio.Queue[Event], Event]] = deque()
        self.waking = False  # a hand-over is scheduled on the loop

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Mailbox:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = cls(loop)
        return box

    def put(self, queue: asyncio.Queue[Event], event: Event) -> None:
        """Called from any thread; raises RuntimeError once the loop is closed (the receiver is gone)."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self.lock:
            self.pending.append((queue, event))

    def wake(self) -> None:
        """Hand what is pending to the queues, on the loop (called from any thread)."""
        with self.lock:
            if not self.pending or self.waking:
                return
            self.waking = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            ready, self.pending, self.waking = self.pending, deque(), False
        for queue, event in ready:
            queue.put_nowait(event)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


class Generation:
    """Runs `sequences` (one request's choices) on the scheduler; events arrive on this event
    loop's queue."""

    def __init__(self, scheduler: Scheduler, sequences: GenerationSequence | list[GenerationSequence],
                 on_end: Callable[[Generation], None] | None = None):
        mailbox = Mailbox.of(asyncio.get_running_loop())
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.request = Request(sequences, lambda event: mailbox.put(self.queue, event), mailbox.wake)
        self.scheduler = scheduler
        self.sequence = self.request.sequence
        self.on_end = on_end

    def abort(self, error: Exception) -> None:
        """End the answer with `error` now, whatever the scheduler is doing (call on the event loop)."""
        self.queue.put_nowait(Event(error=error))

    async def events(self) -> AsyncIterator[Event]:
        """Events until every choice finished or one failed. Stopping early (a streaming client
        that went away cancels the task consuming this) cancels the request, which frees its
        slots before the scheduler's next step."""
        self.scheduler.submit(self.request)
        finished = 0
        try:
            while True:
                event = await self.queue.get()
                yield event
                finished += event.completion is not None
                if event.error is not None or finished == len(self.request.sequences):
                    return
        finally:
            self.scheduler.cancel(self.request)
            if self.on_end is not None:
                self.on_end(self)

    async def result(self, client: HTTPRequest) -> list[Completion]:
        """The finished completions, one per choice; a failed generation raises its error, and
        `client` leaving raises ClientGone at once, tokens flowing or not."""
        watcher = asyncio.create_task(self._watch(client))
        try:
            completions: dict[int, Completion] = {}
            async for event in self.events():
                if event.error is not None:
                    raise event.error
                if event.completion is not None:
                    completions[event.index] = event.completion
        finally:
            watcher.cancel()
        if len(completions) < len(self.request.sequences):
            raise ClientGone()
        return [completions[i] for i in sorted(completions)]

    async def _watch(self, client: HTTPRequest) -> None:
        """Waits for `client` to disconnect, then cancels the request (its slots are freed before
        the scheduler's next step) and ends the answer. The body was read already: all the
        server can still receive is the disconnect."""
        await wait_for_disconnect(client)
        self.scheduler.cancel(self.request)
        self.abort(ClientGone())


async def sliced_result(call: SlicedCall, client: HTTPRequest) -> Any:
    """The result of `call` (a sliced call on the scheduler); `client` leaving cancels it (it stops
    before its next slice) and raises ClientGone."""
    result = asyncio.wrap_future(call.future)
    watcher = asyncio.create_task(wait_for_disconnect(client))
    try:
        await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not result.done():
            call.cancel()
    if not result.done():
        raise ClientGone()
    return result.result()


async def wait_for_disconnect(client: HTTPRequest) -> None:
    """Returns when the client of `client` has left (the request's body must have been read)."""
    while (await client.receive())["type"] != "http.disconnect":
        pass


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def sse_error(error: Exception) -> str:
    """A failure after the answer started: an error event (the status line was already sent)."""
    api = from_exception(error)
    return sse(error_body(api.message, api.type, api.param, api.code))
