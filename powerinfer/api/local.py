"""OpenAI-shaped answers in-process, for `LLM.create_completion` and `LLM.create_chat_completion`:
the same request validation, preparation and reply building as the server, run on a scheduler
of their own (one slot per choice, so `n` choices share one prefill as on the server)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from powerinfer.api.prepare import Prepared, prepare_chat, prepare_completion
from powerinfer.api.replies import OpenAIReply
from powerinfer.api.schemas import ChatRequest, CompletionRequest, OpenAIRequest, validation_message
from powerinfer.errors import PowerInferError
from powerinfer.runtime.scheduler import Event, Request, Scheduler

if TYPE_CHECKING:
    from powerinfer.llm import LLM


def validated(model: type[BaseModel], fields: dict[str, Any]) -> Any:
    """`fields` as the request `model`; bad fields raise a PowerInferError naming them."""
    try:
        return model.model_validate(fields)
    except ValidationError as error:
        message, _ = validation_message(error.errors())
        raise PowerInferError(message) from None


def _events(llm: LLM, prepared: Prepared) -> Iterator[Event]:
    """The scheduler's events for one request, until every choice finished (an error raises)."""
    engine = llm.new_engine(len(prepared.sequences))
    scheduler = Scheduler(engine)
    received: queue.SimpleQueue[Event] = queue.SimpleQueue()
    request = Request(prepared.sequences, received.put)
    try:
        scheduler.submit(request)
        finished = 0
        while finished < len(prepared.sequences):
            event = received.get()
            if event.error is not None:
                raise event.error
            finished += event.completion is not None
            yield event
    finally:  # also when the caller stops iterating a stream early
        scheduler.cancel(request)
        scheduler.close()


def _answer(llm: LLM, body: OpenAIRequest, prepared: Prepared, chat: bool) -> dict | Iterator[dict]:
    if prepared.echo is not None:
        prepared.echo.score(llm)
    reply = OpenAIReply(llm.path.name, llm.tokenizer, prepared, chat)
    if body.stream:
        return _stream(llm, reply, prepared, body.stream_options is not None and body.stream_options.include_usage)
    completions = {e.index: e.completion for e in _events(llm, prepared) if e.completion is not None}
    return reply.whole([completions[i] for i in sorted(completions)])


def _stream(llm: LLM, reply: OpenAIReply, prepared: Prepared, include_usage: bool) -> Iterator[dict]:
    yield from reply.opening()
    for event in _events(llm, prepared):
        yield from reply.chunks(event)
    if include_usage:
        yield reply.usage_chunk()


def create_completion(llm: LLM, fields: dict[str, Any]) -> dict | Iterator[dict]:
    body = validated(CompletionRequest, fields)
    return _answer(llm, body, prepare_completion(llm, body), chat=False)


def create_chat_completion(llm: LLM, fields: dict[str, Any]) -> dict | Iterator[dict]:
    body = validated(ChatRequest, fields)
    return _answer(llm, body, prepare_chat(llm, body), chat=True)
