"""OpenAI-shaped answers in-process, for `LLM.create_completion` and `LLM.create_chat_completion`:
the same request validation, preparation and reply building as the server, run on a scheduler
of their own (one slot per choice, so `n` choices share one prefill as on the server)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from powerinfer.api.prepare import Prepared, prepare_chat, prepare_completions
from powerinfer.api.replies import OpenAIReply, joined, merged, merged_usage_chunk
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


def _answer(llm: LLM, body: OpenAIRequest, batch: list[Prepared], chat: bool) -> dict | Iterator[dict]:
    """The answer to a request of one prompt or (completions) a batch of them, one after the other."""
    for prepared in batch:
        if prepared.echo is not None:
            prepared.echo.score(llm)
    replies = joined([OpenAIReply(llm.path.name, llm.tokenizer, prepared, chat) for prepared in batch])
    if body.stream:
        return _stream(llm, replies, batch, body.stream_options is not None and body.stream_options.include_usage)
    answers = []
    for reply, prepared in zip(replies, batch):
        completions = {e.index: e.completion for e in _events(llm, prepared) if e.completion is not None}
        answers.append(reply.whole([completions[i] for i in sorted(completions)]))
    return merged(answers)


def _stream(llm: LLM, replies: list[OpenAIReply], batch: list[Prepared], include_usage: bool) -> Iterator[dict]:
    for reply, prepared in zip(replies, batch):
        yield from reply.opening()
        for event in _events(llm, prepared):
            yield from reply.chunks(event)
    if include_usage:
        yield merged_usage_chunk(replies)


def create_completion(llm: LLM, fields: dict[str, Any]) -> dict | Iterator[dict]:
    body = validated(CompletionRequest, fields)
    return _answer(llm, body, prepare_completions(llm, body), chat=False)


def create_chat_completion(llm: LLM, fields: dict[str, Any]) -> dict | Iterator[dict]:
    body = validated(ChatRequest, fields)
    return _answer(llm, body, [prepare_chat(llm, body)], chat=True)
