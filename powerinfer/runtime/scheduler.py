"""Continuous batching: one worker thread owns the engine; requests join and leave between decode steps.

Each loop turn prefills the requests that found free slots, then runs one batched decode step for
every active sequence. A request may hold several sequences (OpenAI's `n`): its prompt is
evaluated once and the slot's cache copied into the others. Requests beyond the engine's slots
wait in a first-come queue. Results go back through
each request's `deliver` callback, called on the worker thread (the server hands them to its event
loop), so the callback must be quick and must not block. A request may also have a `flush`
callback, called once after each round of prefills and each decode step that delivered it
events: the server queues a step's events and wakes its event loop once for all of them.

`call_sliced(steps)` runs other work (embeddings) on the worker, so the model is only ever driven
from one thread, in slices, one slice per loop turn beside the decode step. While sequences generate, a slice is sized to take about as
long as a decode step, and slices take at most as much of the worker's time as decode steps do
(a slice that cost more than a step waits out the difference in steps without one), so their
inter-token latency stays within about twice its solo value.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from powerinfer.errors import PowerInferError
from powerinfer.logs import failure_text
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.sequence import Completion, GenerationSequence, TokenLogprob

log = logging.getLogger(__name__)
RATE_WINDOW_SECONDS = 10.0  # tokens/s is averaged over this window
FIRST_SLICE_TOKENS = 16  # a sliced call's first slice beside generation, before its cost per token is measured
CLOSE_WAIT_SECONDS = 2.0  # how long close() waits for a step in progress before giving up on it


@dataclass
class Event:
    """Text of one sequence (`index` among the request's); the sequence's last event has
    `completion`, and an `error` ends the whole request."""

    text: str = ""
    completion: Completion | None = None
    error: Exception | None = None
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def final(self) -> bool:
        """The last event of this sequence."""
        return self.completion is not None or self.error is not None


class LatencyObserver(Protocol):
    """Receives latencies in seconds (the server's metrics histograms)."""

    def queue_wait(self, seconds: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...


class Request:
    """Sequences to generate from one prompt and where their events go. `cancel` may be called
    from any thread."""

    def __init__(self, sequences: GenerationSequence | Sequence[GenerationSequence], deliver: Callable[[Event], None],
                 flush: Callable[[], None] | None = None):
        self.sequences = [sequences] if isinstance(sequences, GenerationSequence) else list(sequences)
        self.deliver, self.flush = deliver, flush
        self.cancelled = False
        self.submitted = self.admitted = 0.0  # time.perf_counter() marks, for the latency observer
        self.last_token_at: list[float | None] = [None] * len(self.sequences)
        self.done = 0  # sequences finished

    @property
    def sequence(self) -> GenerationSequence:
        return self.sequences[0]


def one_slice(fn: Callable[..., Any], *args: Any) -> Generator[int, int, Any]:
    """Work that is short (scoring one prompt) as a sliced call's steps: all of it in its first slice."""
    yield 0
    return fn(*args)


class SlicedCall:
    """Work the worker runs in slices (see `Scheduler.call_sliced`); `future` holds its result or
    error. `cancel` may be called from any thread: the work stops before its next slice."""

    def __init__(self, steps: Callable[[Engine], Generator[int, int, Any]]):
        self.steps = steps
        self.future: Future = Future()
        self.cancelled = False
        self.running: Generator[int, int, Any] | None = None
        self.seconds_per_token = 0.0  # measured on its slices

    def cancel(self) -> None:
        self.cancelled = True
        self.future.cancel()  # at once when no slice ran yet


@dataclass
class Stats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queued: int = 0
    active: int = 0
    sliced: int = 0  # sliced calls not finished yet


class Scheduler:
    """Runs requests on `engine`'s slots from one background thread (see the module docstring)."""

    def __init__(self, engine: Engine, observer: LatencyObserver | None = None):
        self.engine = engine
        self.n_slots = engine.n_slots
        self.observer = observer
        self._waiting: deque[Request] = deque()
        self._active: dict[int, tuple[Request, int]] = {}  # slot -> (request, sequence index); worker only
        self._sliced: deque[SlicedCall] = deque()
        self._step_seconds = 0.0  # the last decode step's duration: what a slice beside generation may take
        self._slice_debt = 0.0  # seconds slices ran beside generation beyond what decode steps ran
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
        if len(request.sequences) > self.n_slots:
            raise PowerInferError(f"{len(request.sequences)} sequences asked for, but there are only "
                                  f"{self.n_slots} slots (the server's --parallel)")
        request.submitted = time.perf_counter()
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

    def call_sliced(self, steps: Callable[[Engine], Generator[int, int, Any]]) -> SlicedCall:
        """Run `steps(engine)` on the worker in slices: a generator primed with next(), then sent
        each slice's size in tokens, yielding the tokens it evaluated; what it returns is the
        call's result. Sliced calls take turns, one slice each per loop turn."""
        call = SlicedCall(steps)
        with self._wake:
            if self._stopping:
                raise PowerInferError("the server is shutting down")
            self._sliced.append(call)
            self._stats.sliced += 1
            self._wake.notify()
        return call

    def slots(self) -> list[tuple[bool, int, int]]:
        """Per slot: (generating, tokens in its cache, tokens generated), as seen now."""
        with self._wake:  # the worker changes _active under this lock
            active = dict(self._active)
        return [(s in active, self.engine.tokens_in(s),
                 len(active[s][0].sequences[active[s][1]].generated) if s in active else 0)
                for s in range(self.n_slots)]

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
            if not self._waiting and not self._active and not self._sliced:
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
                while not self._stopping and not self._waiting and not self._active and not self._sliced:
                    self._wake.wait()
                if self._stopping:
                    break
                admitted = self._admit()
            for slots, request in admitted:
                self._prefill(slots, request)
                self._progressed()
            self._flush()
            self._drop_cancelled()
            if self._active:
                self._decode_step()
                self._progressed()
                self._flush()
            if self._sliced and (not self._active or self._slice_debt <= 0):
                self._run_slice()
                self._progressed()
        self._fail_all(PowerInferError("the server is shutting down"))
        self._flush()

    def _admit(self) -> list[tuple[list[int], Request]]:
        """Waiting requests moved into free slots, first come first served, lowest slots first
        (caller holds the lock). A request waits until all its sequences have slots."""
        free = [s for s in range(self.n_slots) if s not in self._active]
        admitted = []
        while self._waiting and len(self._waiting[0].sequences) <= len(free):
            request = self._waiting.popleft()
            slots, free = free[: len(request.sequences)], free[len(request.sequences) :]
            for index, slot in enumerate(slots):
                self._active[slot] = (request, index)
            admitted.append((slots, request))
        self._stats.queued, self._stats.active = len(self._waiting), len(self._active)
        return admitted

    def _run_slice(self) -> None:
        """One slice of the first sliced call, which then goes to the back of their queue."""
        with self._wake:
            call = self._sliced.popleft()
        if self._slice(call):
            with self._wake:
                self._sliced.append(call)
        else:
            with self._wake:
                self._stats.sliced -= 1

    def _slice(self, call: SlicedCall) -> bool:
        """Runs one slice of `call`; returns whether there is more to do."""
        if call.cancelled:
            if call.running is not None:
                call.running.close()
            if not call.future.done():
                call.future.set_exception(CancelledError())
            return False
        if call.running is None and not call.future.set_running_or_notify_cancel():
            return False
        # Beside generation, a slice costs about one decode step; alone, a whole batch.
        tokens = self.engine.n_batch
        if self._active:
            tokens = FIRST_SLICE_TOKENS if not call.seconds_per_token else \
                max(1, min(tokens, int(self._step_seconds / call.seconds_per_token)))
        started = time.perf_counter()
        try:
            if call.running is None:
                call.running = call.steps(self.engine)
                next(call.running)
            done = call.running.send(tokens)
        except StopIteration as finished:
            call.future.set_result(finished.value)
            return False
        except Exception as error:  # noqa: BLE001 - the caller gets it
            call.future.set_exception(error)
            return False
        elapsed = time.perf_counter() - started
        if self._active:
            self._slice_debt += elapsed
        if done:
            call.seconds_per_token = elapsed / done
        return True

    def _prefill(self, slots: list[int], request: Request) -> None:
        if request.cancelled:
            self._release_request(request)
            return
        request.admitted = time.perf_counter()
        if self.observer is not None:
            self.observer.queue_wait(request.admitted - request.submitted)
        prompt = request.sequence.prompt
        try:
            # No prefix reuse: results then equal a fresh evaluation exactly (as `LLM.generate` does).
            logits = self.engine.prefill(slots[0], prompt, reuse_prefix=False)
            for slot in slots[1:]:  # the other choices start from the same evaluated prompt
                self.engine.copy_slot(slots[0], slot)
        except Exception as error:  # noqa: BLE001 - one bad request must not stop the others
            self._fail(slots[0], error)
            return
        elapsed = time.perf_counter() - request.admitted
        with self._wake:
            self._stats.prompt_tokens += len(prompt)
        generated = 0
        for slot in slots:
            sequence = request.sequences[self._active[slot][1]]
            sequence.timings.prompt_seconds = elapsed
            if sequence.finished:  # max_tokens=0 evaluates the prompt only
                self._emit(slot, "")
            else:
                generated += self._accept(slot, logits)
            if request.cancelled:  # it failed (a choice that finished at once just left its slot)
                break
        self._count(generated)

    def _decode_step(self) -> None:
        slots = sorted(self._active)
        try:
            started = time.perf_counter()
            logits = self.engine.decode([(s, self._sequence(s).last_token) for s in slots])
            elapsed = self._step_seconds = time.perf_counter() - started
            self._slice_debt = max(0.0, self._slice_debt - elapsed)
        except Exception as error:  # noqa: BLE001 - fail this step's requests, keep serving
            for slot in slots:
                self._fail(slot, error)
            return
        generated = 0
        for row, slot in enumerate(slots):
            if slot not in self._active:  # its request failed on an earlier row
                continue
            timings = self._sequence(slot).timings
            timings.decode_seconds += elapsed  # each sequence waited for the whole step
            timings.decode_steps += 1
            generated += self._accept(slot, logits[row])
        self._count(generated)

    def _sequence(self, slot: int) -> GenerationSequence:
        request, index = self._active[slot]
        return request.sequences[index]

    def _accept(self, slot: int, logits: torch.Tensor) -> int:
        """Sample the next token of the sequence in `slot` and pass on its text; returns the
        number of tokens it generated (0 at the end of generation)."""
        request, index = self._active[slot]
        sequence = request.sequences[index]
        before = len(sequence.generated)
        try:
            text = sequence.accept(logits)
        except Exception as error:  # noqa: BLE001
            self._fail(slot, error)
            return 0
        self._observe_token(request, index)
        self._emit(slot, text)
        return len(sequence.generated) - before

    def _observe_token(self, request: Request, index: int) -> None:
        if self.observer is None:
            return
        now, last = time.perf_counter(), request.last_token_at[index]
        if last is not None:
            self.observer.inter_token(now - last)
        elif all(t is None for t in request.last_token_at):  # the request's first token
            self.observer.first_token(now - request.submitted)
        request.last_token_at[index] = now

    def _emit(self, slot: int, text: str) -> None:
        request, index = self._active[slot]
        sequence = request.sequences[index]
        finished = sequence.finished
        logprobs = sequence.take_logprobs()
        if text or finished or logprobs:
            self._send(request, Event(text, sequence.completion() if finished else None, index=index, logprobs=logprobs))
        if finished:
            request.done += 1
            self._release(slot)

    def _fail(self, slot: int, error: Exception) -> None:
        """Fail the request in `slot`, with all its sequences."""
        if not isinstance(error, PowerInferError):
            log.error("generation failed: %s", failure_text(error))
        if slot in self._active:
            request = self._active[slot][0]
            request.cancelled = True
            self._send(request, Event(error=error))
            self._release_request(request)

    def _fail_all(self, error: Exception) -> None:
        for slot in list(self._active):
            self._fail(slot, error)
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
            sliced, self._sliced = self._sliced, deque()
            self._stats.sliced = 0
        for request in waiting:
            self._send(request, Event(error=error))
        for call in sliced:
            if not call.future.cancel():  # running: cancel() refuses, so it fails instead
                call.future.set_exception(error)

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
        for slot in [s for s, (r, _) in self._active.items() if r.cancelled]:
            self._release(slot)

    def _release_request(self, request: Request) -> None:
        for slot in [s for s, (r, _) in self._active.items() if r is request]:
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
