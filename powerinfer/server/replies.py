"""Answers in the shapes clients expect: OpenAI completions and chat (whole or streamed), llama.cpp's
/completion, Prometheus metrics."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from powerinfer.runtime.scheduler import Scheduler
from powerinfer.runtime.sequence import Completion, GenerationSequence
from powerinfer.server.generation import Generation, sse, sse_error


def usage(completion: Completion) -> dict:
    n = len(completion.tokens)
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": n, "total_tokens": completion.prompt_tokens + n}


class OpenAIReply:
    """Answers in OpenAI's shapes for text completions and chat completions."""

    def __init__(self, object: str, model: str, chat: bool):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object, self.model, self.chat = object, model, chat
        self.created = int(time.time())

    def _envelope(self, object: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, text: str | None, finish_reason: str | None, whole: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish_reason}

    def whole(self, completion: Completion) -> dict:
        return {**self._envelope(self.object, [self._choice(completion.text, completion.finish_reason, True)]),
                "usage": usage(completion)}

    async def stream(self, generation: Generation, include_usage: bool) -> AsyncIterator[str]:
        chunk = f"{self.object}.chunk" if self.chat else self.object
        if self.chat:
            yield sse(self._envelope(chunk, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "finish_reason": None}]))
        async for event in generation.events():
            if event.error is not None:
                yield sse_error(event.error)
                return
            if event.text:
                yield sse(self._envelope(chunk, [self._choice(event.text, None, False)]))
            if event.completion is not None:
                yield sse(self._envelope(chunk, [self._choice(None, event.completion.finish_reason, False)]))
                if include_usage:
                    yield sse({**self._envelope(chunk, []), "usage": usage(event.completion)})
        yield sse("[DONE]")


def llama_final(sequence: GenerationSequence, completion: Completion, model: str) -> dict:
    """The fields of llama.cpp's last /completion answer, besides `content`."""
    t = completion.timings
    generated = len(completion.tokens)
    prompt_ms, predicted_ms = t.prompt_seconds * 1e3, t.decode_seconds * 1e3
    if completion.finish_reason == "length":
        stop_type = "limit"
    else:
        stop_type = "word" if sequence.stop.stopped else "eos"
    return {
        "stop": True, "model": model, "tokens_predicted": generated, "tokens_evaluated": completion.prompt_tokens,
        "stop_type": stop_type,
        "timings": {
            "prompt_n": completion.prompt_tokens, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(completion.prompt_tokens, 1),
            "prompt_per_second": t.prompt_tokens_per_second,
            "predicted_n": generated, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(t.decode_steps, 1),
            "predicted_per_second": t.decode_tokens_per_second,
        },
    }


async def llama_stream(generation: Generation, model: str) -> AsyncIterator[str]:
    async for event in generation.events():
        if event.error is not None:
            yield sse_error(event.error)
            return
        if event.completion is not None:
            yield sse({"content": event.text, **llama_final(generation.sequence, event.completion, model)})
        elif event.text:
            yield sse({"content": event.text, "stop": False})


def prometheus(scheduler: Scheduler) -> str:
    stats = scheduler.stats()
    rows = [
        ("requests_total", "counter", "Generation requests received.", stats.requests),
        ("prompt_tokens_total", "counter", "Prompt tokens evaluated.", stats.prompt_tokens),
        ("tokens_generated_total", "counter", "Tokens generated.", stats.generated_tokens),
        ("tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.", scheduler.tokens_per_second()),
        ("queue_length", "gauge", "Requests waiting for a slot.", stats.queued),
        ("active_slots", "gauge", "Slots generating now.", stats.active),
        ("slots", "gauge", "Slots (--parallel).", scheduler.n_slots),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP powerinfer_{name} {help_text}", f"# TYPE powerinfer_{name} {kind}", f"powerinfer_{name} {value:g}"]
    return "\n".join(lines) + "\n"
