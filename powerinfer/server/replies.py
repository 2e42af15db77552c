"""llama.cpp's /completion answers (OpenAI's shapes are in powerinfer.api.replies, shared with the
Python API)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from powerinfer.api.replies import OpenAIReply, merged_usage_chunk
from powerinfer.api.responses import ResponseShape
from powerinfer.runtime.sequence import Completion, GenerationSequence
from powerinfer.server.generation import Generation, sse, sse_error


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


async def openai_stream(replies: list[OpenAIReply], starts: list[Callable[[], Generation]],
                        include_usage: bool) -> AsyncIterator[str]:
    """An OpenAI answer as server-sent events, ending with [DONE] (or an error event); a batch's
    prompts one after the other, each generation started (`starts`) when its turn comes."""
    for reply, start in zip(replies, starts):
        for chunk in reply.opening():
            yield sse(chunk)
        async for event in start().events():
            if event.error is not None:
                yield sse_error(event.error)
                return
            for chunk in reply.chunks(event):
                yield sse(chunk)
    if include_usage:
        yield sse(merged_usage_chunk(replies))
    yield sse("[DONE]")


async def responses_stream(shape: ResponseShape, reply: OpenAIReply, start: Callable[[], Generation]) -> AsyncIterator[str]:
    """A Responses API answer as its events (an error event if generation fails)."""
    for event in shape.start():
        yield sse(event)
    async for event in start().events():
        if event.error is not None:
            yield sse_error(event.error)
            return
        for chunk in reply.chunks(event):
            for out in shape.events(chunk):
                yield sse(out)
    for out in shape.finish(reply.usage_chunk()["usage"]):
        yield sse(out)
