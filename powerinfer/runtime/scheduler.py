"""Continuous batching: one worker thread owns the engine; requests join and leave between decode steps.

Each loop turn prefills the requests that found a free slot, then runs one batched decode step for
every active sequence. Requests beyond the engine's slots wait in a queue. Results go back through
each request's `deliver` callback, called on the worker thread (the server hands them to its event
loop), so the callback must be quick and must not block. A request may also have a `flush`
callback, called once after each round of prefills and each decode step that delivered it
events: the server queues a step's events and wakes its event loop once for all of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from powerinfer.errors import PowerInferError
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.sequence import Completion, GenerationSequence

log = logging.getLogger(__name__)
RATE_WINDOW_SECONDS = 10.0  # tokens/s is averaged over this window
CLOSE_WAIT_SECONDS = 2.0  # how long close() waits for a step in progress before giving up on it


@dataclass
class Event:
    """Text for one request; the last event has `completion` (finished) or `error` (failed)."""

    text: str = ""
    completion: Completion | None = None
    error: Exception | None = None

    @property
    def final(self) -> bool:
        return self.completion is not None or self.error is not None


class Request:
    """A sequence to generate and where its events go. `cancel` may be called from any thread."""

    def __init__(self, sequence: GenerationSequence, deliver: Callable[[Event], None],
                 flush: Callable[[], None] | None = None):
        self.sequence = sequence
        self.deliver, self.flush = deliver, flush
        self.cancelled = False


@dataclass
class Stats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queued: int = 0
    active: int = 0


class Scheduler:
    """Runs requests on `engine`'s slots from one background thread (see the module docstring)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.n_slots = engine.n_slots
        self._waiting: deque[Request] = deque()
        self._active: dict[int, Request] = {}  # slot -> request; touched by the worker only
        self._wake = threading.Condition()
        self._stopping = False
        self._stats = Stats()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent decode steps
        self._unflushed: set[Callable[[], None]] = set()  # flush callbacks owed; touched by the worker only
        self._progress_at = time.monotonic()  # when the worker last finished a step or found nothing to do
        self._thread = threading.Thread(target=self._loop, name="powerinfer-scheduler", daemon=True)
        self._thread.start()

    # -- called from other threads --------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self._wake:
            if self._stopping:
                raise PowerInferError("the server is shutting down")
            if not self._waiting and not self._active:  # an idle worker has not been stuck meanwhile
                self._progress_at = time.monotonic()
            self._waiting.append(request)
            self._stats.requests += 1
            self._stats.queued = len(self._waiting)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """Stop generating for `request` (a no-op once it finished); its slot is freed before the next step."""
        with self._wake:
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
                self._stats.queued = len(self._waiting)

    def stats(self) -> Stats:
        with self._wake:
            return Stats(**vars(self._stats))

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_SECONDS."""
        with self._wake:
            self._forget_old(time.perf_counter())
            return sum(n for _, n in self._recent) / RATE_WINDOW_SECONDS

    def stalled_seconds(self) -> float:
        """How long requests have been waiting or running without the worker finishing a step
        (0 while it has nothing to do): a watchdog's measure of a stuck worker."""
        with self._wake:
            if not self._waiting and not self._active:
                return 0.0
            return time.monotonic() - self._progress_at

    def close(self, timeout: float = CLOSE_WAIT_SECONDS) -> bool:
        """Stop the worker: requests still waiting or running fail. Returns False when a step in
        progress did not end within `timeout` (the thread is a daemon: it dies with the process)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the scheduler's current step did not finish within %.0f s; leaving it", timeout)
            return False
        return True

    # -- the worker -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._active:
                    self._wake.wait()
                if self._stopping:
                    break
                admitted = self._admit()
            for slot, request in admitted:
                self._prefill(slot, request)
                self._progressed()
            self._flush()
            self._drop_cancelled()
            if self._active:
                self._decode_step()
                self._progressed()
                self._flush()
        self._fail_all(PowerInferError("the server is shutting down"))
        self._flush()

    def _admit(self) -> list[tuple[int, Request]]:
        """Waiting requests moved into free slots, lowest slot first (caller holds the lock)."""
        free = [s for s in range(self.n_slots) if s not in self._active]
        admitted = []
        while free and self._waiting:
            request = self._waiting.popleft()
            slot = free.pop(0)
            self._active[slot] = request
            admitted.append((slot, request))
        self._stats.queued, self._stats.active = len(self._waiting), len(self._active)
        return admitted

    def _prefill(self, slot: int, request: Request) -> None:
        if request.cancelled:
            self._release(slot)
            return
        sequence = request.sequence
        try:
            started = time.perf_counter()
            # No prefix reuse: results then equal a fresh evaluation exactly (as `LLM.generate` does).
            logits = self.engine.prefill(slot, sequence.prompt, reuse_prefix=False)
            sequence.timings.prompt_seconds = time.perf_counter() - started
        except Exception as error:  # noqa: BLE001 - one bad request must not stop the others
            self._fail(slot, error)
            return
        with self._wake:
            self._stats.prompt_tokens += len(sequence.prompt)
        if sequence.finished:  # max_tokens=0 evaluates the prompt only
            self._emit(slot, "")
        else:
            self._count(self._accept(slot, logits))

    def _decode_step(self) -> None:
        slots = sorted(self._active)
        try:
            started = time.perf_counter()
            logits = self.engine.decode([(s, self._active[s].sequence.last_token) for s in slots])
            elapsed = time.perf_counter() - started
        except Exception as error:  # noqa: BLE001 - fail this step's requests, keep serving
            for slot in slots:
                self._fail(slot, error)
            return
        generated = 0
        for row, slot in enumerate(slots):
            timings = self._active[slot].sequence.timings
            timings.decode_seconds += elapsed  # each sequence waited for the whole step
            timings.decode_steps += 1
            generated += self._accept(slot, logits[row])
        self._count(generated)

    def _accept(self, slot: int, logits: torch.Tensor) -> int:
        """Sample the next token of the sequence in `slot` and pass on its text; returns the
        number of tokens it generated (0 at the end of generation)."""
        sequence = self._active[slot].sequence
        before = len(sequence.generated)
        try:
            text = sequence.accept(logits)
        except Exception as error:  # noqa: BLE001
            self._fail(slot, error)
            return 0
        self._emit(slot, text)
        return len(sequence.generated) - before

    def _emit(self, slot: int, text: str) -> None:
        request = self._active[slot]
        finished = request.sequence.finished
        if text or finished:
            self._send(request, Event(text, request.sequence.completion() if finished else None))
        if finished:
            self._release(slot)

    def _fail(self, slot: int, error: Exception) -> None:
        if not isinstance(error, PowerInferError):
            log.exception("generation failed", exc_info=error)
        request = self._active.get(slot)
        if request is not None:
            self._send(request, Event(error=error))
            self._release(slot)

    def _fail_all(self, error: Exception) -> None:
        for slot in list(self._active):
            self._fail(slot, error)
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
        for request in waiting:
            self._send(request, Event(error=error))

    def _send(self, request: Request, event: Event) -> None:
        try:
            request.deliver(event)
        except Exception:  # noqa: BLE001 - the receiver is gone (its event loop closed)
            request.cancelled = True
            return
        if request.flush is not None:
            self._unflushed.add(request.flush)

    def _flush(self) -> None:
        flushes, self._unflushed = self._unflushed, set()
        for flush in flushes:
            try:
                flush()
            except Exception:  # noqa: BLE001 - receivers gone: their next deliver fails and cancels them
                pass

    def _drop_cancelled(self) -> None:
        for slot in [s for s, r in self._active.items() if r.cancelled]:
            self._release(slot)

    def _release(self, slot: int) -> None:
        self.engine.release(slot)
        with self._wake:
            del self._active[slot]
            self._stats.active = len(self._active)

    def _progressed(self) -> None:
        with self._wake:
            self._progress_at = time.monotonic()

    def _count(self, tokens: int) -> None:
        now = time.perf_counter()
        with self._wake:
            self._stats.generated_tokens += tokens
            self._recent.append((now, tokens))
            self._forget_old(now)

    def _forget_old(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_SECONDS:
            self._recent.popleft()
