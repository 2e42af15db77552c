"""The HTTP app: OpenAI-compatible routes, llama.cpp-style routes, health and metrics.

`create_app(llm)` serves a loaded `LLM`; `create_app(factory)` loads one in a background thread at
startup, answering 503 on /health (and on the model routes) until it is ready. Parsing bodies,
tokenizing and template rendering run in worker threads, so a large request never holds up others.
`create_app(..., replica=name)` is one of several replicas behind a router (powerinfer/server/ray_app.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from powerinfer.api import schemas
from powerinfer.api.prepare import Prepared, prepare_chat, prepare_completions
from powerinfer.api.replies import OpenAIReply, embedding_list, joined, merged
from powerinfer.api.responses import ResponseShape, ResponsesRequest
from powerinfer.errors import PowerInferError
from powerinfer.llm import LLM
from powerinfer.logs import cap_log_values
from powerinfer.runtime.scheduler import Scheduler, one_slice
from powerinfer.runtime.sequence import GenerationSequence
from powerinfer.server.bodies import body_workers, json_body
from powerinfer.server.errors import APIError, install_handlers
from powerinfer.server.gate import RequestGate
from powerinfer.server.generation import ClientGone, Generation, sliced_result
from powerinfer.server.limits import (
    DEFAULT_MAX_BODY_MEMORY,
    DEFAULT_MAX_BODY_SIZE,
    DEFAULT_MAX_EMBEDDING_TOKENS,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_WATCHDOG_SECONDS,
)
from powerinfer.server.metrics import Metrics
from powerinfer.server.model_names import ANY_NAME, ModelNames
from powerinfer.server.rendering import json_answer
from powerinfer.server.replica import REPLICA_LABEL, ReplicaHeader, label_series
from powerinfer.server.replies import llama_final, llama_stream, openai_stream, responses_stream
from powerinfer.server.request_log import RequestLog, note_generation

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Each route's body, parsed and validated off the event loop.
TokenizeBody = json_body(schemas.TokenizeRequest)
DetokenizeBody = json_body(schemas.DetokenizeRequest)
CompletionBody = json_body(schemas.CompletionRequest)
ChatBody = json_body(schemas.ChatRequest)
ResponsesBody = json_body(ResponsesRequest)
EmbeddingBody = json_body(schemas.EmbeddingRequest)
LlamaCompletionBody = json_body(schemas.LlamaCompletionRequest)


class ServerState:
    """The model and its scheduler once loaded, or why loading failed."""

    def __init__(self, parallel: int, watchdog_seconds: float, names: ModelNames = ANY_NAME):
        self.parallel, self.watchdog_seconds, self.names = parallel, watchdog_seconds, names
        self.llm: LLM | None = None
        self.scheduler: Scheduler | None = None
        self.model_ids: tuple[str, ...] = ()  # the aliases, else the file's name: never where the model lives
        self.model_id = ""  # the first of them, named in every answer
        self.load_error: Exception | None = None
        self.started = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.live: set[Generation] = set()  # requests answering now (ended with an error on shutdown)
        self.shutting_down = False
        self.metrics = Metrics()

    def start(self, llm: LLM) -> None:
        self.model_ids = self.names.served(llm.path)
        self.model_id = self.model_ids[0]
        self.scheduler = self.metrics.scheduler = Scheduler(llm.new_engine(self.parallel), observer=self.metrics)
        self.llm = llm

    def ready(self) -> tuple[LLM, Scheduler]:
        if self.llm is None or self.scheduler is None:
            raise APIError(503, "the model failed to load" if self.load_error else "the model is loading",
                           type="unavailable_error")
        return self.llm, self.scheduler

    def check_model(self, name: str | None) -> None:
        """Any name is answered by the one model, unless the names are strict (`ModelNames`)."""
        llm, _ = self.ready()
        if not self.names.accepts(name, llm.path):
            raise APIError(404, f"model {name!r} not found (this server runs {self.model_id!r})", param="model",
                           code="model_not_found")


    def health(self) -> tuple[int, str]:
        if self.llm is None or self.scheduler is None:
            return 503, "error" if self.load_error else "loading"
        if self.shutting_down:
            return 503, "shutting down"
        if self.scheduler.stalled_seconds() > self.watchdog_seconds:
            return 503, "stalled"
        return 200, "ok"

    def begin_shutdown(self) -> None:
        """End every answer in progress with an error (streams get an error event); callable from
        a signal handler: the work happens on the event loop."""
        self.shutting_down = True
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._end_live)

    def _end_live(self) -> None:
        for generation in list(self.live):
            generation.abort(APIError(503, "the server is shutting down", type="unavailable_error"))

    def generation(self, scheduler: Scheduler, sequences: GenerationSequence | list[GenerationSequence]) -> Generation:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", type="unavailable_error")
        generation = Generation(scheduler, sequences, on_end=self.live.discard)
        self.live.add(generation)
        note_generation(generation)
        return generation


def create_app(llm: LLM | Callable[[], LLM], parallel: int = 1,
               on_load_error: Callable[[Exception], None] | None = None, *,
               allowed_hosts: Collection[str] | None = None, api_keys: Collection[str] = (),
               max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               watchdog_seconds: float = DEFAULT_WATCHDOG_SECONDS, replica: str | None = None,
               max_embedding_tokens: int = DEFAULT_MAX_EMBEDDING_TOKENS, body_timeout: float = DEFAULT_READ_TIMEOUT,
               max_body_memory: int = DEFAULT_MAX_BODY_MEMORY, model_names: ModelNames = ANY_NAME) -> FastAPI:
    """The server app over `llm` (or a function that loads it), with `parallel` KV-cache slots.

    `allowed_hosts`: names the Host header may carry (None: any); `api_keys`: keys a request must
    present as a bearer token (none: no key needed); `max_body_size`: bytes per request body;
    `watchdog_seconds`: /health answers 503 once work has waited this long without the
    scheduler finishing a step; `replica`: this app's name among several serving the same model
    (every answer carries it in an x-powerinfer-replica header, and /metrics labels its series with it);
    `max_embedding_tokens`: tokens one /v1/embeddings request may ask for; `body_timeout`: seconds
    for a request's whole body; `max_body_memory`: bytes of all the bodies being read at once;
    `model_names`: the names it serves under, and whether a request naming another is refused.
    """
    if parallel < 1:
        raise PowerInferError("parallel must be >= 1")
    cap_log_values()
    state = ServerState(parallel, watchdog_seconds, model_names)

    def load(factory: Callable[[], LLM]) -> None:
        try:
            state.start(factory())
        except Exception as error:  # noqa: BLE001 - reported through on_load_error / health
            state.load_error = error
            if on_load_error is not None:
                on_load_error(error)
            else:
                log.error("loading the model failed: %s", error)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        if isinstance(llm, LLM):
            state.start(llm)
        else:
            threading.Thread(target=load, args=(llm,), name="powerinfer-load", daemon=True).start()
        yield
        if state.scheduler is not None:
            state.scheduler.close()

    app = FastAPI(title="powerinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server, app.state.body_workers = state, body_workers()
    app.add_middleware(RequestGate, allowed_hosts=allowed_hosts, api_keys=api_keys, max_body_size=max_body_size,
                       body_timeout=body_timeout, max_body_memory=max_body_memory)
    if replica is not None:  # added last, so outermost: the gate's refusals name the replica too
        app.add_middleware(ReplicaHeader, name=replica)
    app.add_middleware(RequestLog)  # outermost: refused requests get their line too
    install_handlers(app)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the connection is closed

    @app.get("/health")
    async def health() -> JSONResponse:
        status, word = state.health()
        return JSONResponse({"status": word}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.ready()
        text = state.metrics.text().decode()
        if replica is not None:
            text = label_series(text, REPLICA_LABEL, replica)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        llm, _ = state.ready()
        return {"object": "list", "data": [{"id": name, "object": "model", "created": state.started,
                                            "owned_by": "powerinfer", "meta": {"n_ctx": llm.n_ctx,
                                                                               "n_vocab": llm.config.n_vocab}}
                                           for name in state.model_ids]}

    @app.get("/props")
    async def props() -> dict:
        """llama-server's: what its web UI and clients read (the model's path is not among them)."""
        llm, _ = state.ready()
        defaults = schemas.LlamaCompletionRequest(prompt="")
        params = {**defaults.sampling(), "seed": -1, "n_predict": defaults.n_predict, "stop": [], "n_probs": 0,
                  "stream": False, "logit_bias": []}
        return {"default_generation_settings": {"n_ctx": llm.n_ctx, "params": params, "model": state.model_id},
                "total_slots": state.parallel, "model_path": state.model_id, "model_alias": state.model_id,
                "chat_template": llm.tokenizer.chat_template or "", "modalities": {"vision": False, "audio": False},
                "build_info": f"powerinfer {version('powerinfer')}"}

    @app.get("/slots")
    async def slots() -> list[dict]:
        llm, scheduler = state.ready()
        return [{"id": slot, "n_ctx": llm.n_ctx, "is_processing": busy, "state": int(busy), "n_tokens": cached,
                 "next_token": {"n_decoded": decoded}}
                for slot, (busy, cached, decoded) in enumerate(scheduler.slots())]

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> Response:
        llm, _ = state.ready()
        return await json_answer({"tokens": await run_in_threadpool(llm.tokenize, body.content, add_bos=body.add_special,
                                                                    special=True)})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> Response:
        llm, _ = state.ready()

        def checked_text() -> str:  # proportional to the ids: in a worker thread
            bad = next((t for t in body.tokens if t >= llm.config.n_vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is out of range (vocabulary of {llm.config.n_vocab})",
                               param="tokens")
            return llm.detokenize(body.tokens, special=True)

        return await json_answer({"content": await run_in_threadpool(checked_text)})

    async def openai_answer(body: schemas.OpenAIRequest, prepare: Callable[[LLM, Any], list[Prepared]],
                            request: Request, chat: bool) -> Response:
        state.check_model(body.model)
        llm, scheduler = state.ready()
        if body.choices > scheduler.n_slots:
            raise APIError(400, f"n={body.choices} is more than the server's {scheduler.n_slots} slots (--parallel)",
                           param="n")
        batch = await run_in_threadpool(prepare, llm, body)  # one per prompt
        for prepared in batch:
            if prepared.echo is not None:  # the prompt's logprobs: on the scheduler's thread, which drives the model
                await sliced_result(scheduler.call_sliced(lambda _, echo=prepared.echo: one_slice(echo.score, llm)), request)
        replies = joined([OpenAIReply(state.model_id, llm.tokenizer, prepared, chat) for prepared in batch])
        # Generations start only when consumed: one that never runs never joins the live set.
        starts = [lambda prepared=prepared: state.generation(scheduler, prepared.sequences) for prepared in batch]
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return streaming(openai_stream(replies, starts, include_usage))

        async def whole(reply: OpenAIReply, start: Callable[[], Generation]) -> dict:
            return reply.whole(await start().result(request))

        tasks = [asyncio.ensure_future(whole(reply, start)) for reply, start in zip(replies, starts)]
        try:
            return await json_answer(merged(await asyncio.gather(*tasks)))
        finally:  # one failed: the others stop too
            for task in tasks:
                task.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody) -> Response:
        return await openai_answer(body, prepare_completions, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody) -> Response:
        return await openai_answer(body, lambda llm, chat: [prepare_chat(llm, chat)], request, chat=True)

    @app.post("/v1/responses")
    async def responses(request: Request, body: ResponsesBody) -> Response:
        chat = body.chat_request()
        state.check_model(chat.model)
        llm, scheduler = state.ready()
        prepared = await run_in_threadpool(prepare_chat, llm, chat)
        reply, shape = OpenAIReply(state.model_id, llm.tokenizer, prepared, chat=True), ResponseShape(body, state.model_id)
        start = lambda: state.generation(scheduler, prepared.sequences)  # noqa: E731
        if chat.stream:
            return streaming(responses_stream(shape, reply, start))
        return await json_answer(shape.whole(reply.whole(await start().result(request))))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request, body: EmbeddingBody) -> Response:
        state.check_model(body.model)
        llm, scheduler = state.ready()
        token_lists = await run_in_threadpool(llm.embedding_ids, body.inputs())
        n_tokens = sum(map(len, token_lists))
        if n_tokens > max_embedding_tokens:
            raise APIError(400, f"{n_tokens} tokens to embed, more than the server's {max_embedding_tokens} per "
                                "request (--max-embedding-tokens)", param="input")
        # On the scheduler's thread (one thread drives the model), in slices beside generation.
        vectors = await sliced_result(scheduler.call_sliced(lambda _: llm.embedding_steps(token_lists)), request)
        # base64 encoding, as the floats, in a worker thread: thousands of values per input
        return await json_answer(await run_in_threadpool(embedding_list, vectors, n_tokens, state.model_id,
                                                         body.encoding_format))

    @app.post("/completion")
    async def llama_completion(request: Request, body: LlamaCompletionBody) -> Response:
        llm, scheduler = state.ready()
        max_tokens = llm.n_ctx if body.n_predict < 0 else body.n_predict
        sequence = await run_in_threadpool(llm.new_sequence, body.prompt, max_tokens, body.stops(), **body.sampling())
        generation = state.generation(scheduler, sequence)
        if body.stream:
            return streaming(llama_stream(generation, state.model_id))
        completion = (await generation.result(request))[0]
        return await json_answer({"content": completion.text, **llama_final(generation.sequence, completion, state.model_id)})

    return app


def streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
