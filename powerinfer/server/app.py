"""The HTTP app: OpenAI-compatible routes, llama.cpp-style routes, health and metrics.

`create_app(llm)` serves a loaded `LLM`; `create_app(factory)` loads one in a background thread at
startup, answering 503 on /health (and on the model routes) until it is ready. `create_app(...,
replica=name)` is one of several replicas behind a router (powerinfer/server/ray_app.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from powerinfer.errors import PowerInferError
from powerinfer.llm import LLM
from powerinfer.runtime.scheduler import Scheduler
from powerinfer.server import schemas
from powerinfer.server.errors import APIError, install_handlers
from powerinfer.server.generation import ClientGone, Generation
from powerinfer.server.replica import REPLICA_LABEL, ReplicaHeader, label_series
from powerinfer.server.replies import OpenAIReply, llama_final, llama_stream, prometheus

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ServerState:
    """The model and its scheduler once loaded, or why loading failed."""

    def __init__(self, parallel: int):
        self.parallel = parallel
        self.llm: LLM | None = None
        self.scheduler: Scheduler | None = None
        self.model_id = ""
        self.load_error: Exception | None = None
        self.started = int(time.time())

    def start(self, llm: LLM) -> None:
        self.model_id = Path(llm.path).name
        self.scheduler = Scheduler(llm.new_engine(self.parallel))
        self.llm = llm

    def ready(self) -> tuple[LLM, Scheduler]:
        if self.llm is None or self.scheduler is None:
            raise APIError(503, "the model failed to load" if self.load_error else "the model is loading",
                           type="unavailable_error")
        return self.llm, self.scheduler

    def check_model(self, name: str | None) -> None:
        """Clients name the model they want; any name of the one loaded is accepted."""
        llm, _ = self.ready()
        if name and name not in {self.model_id, Path(llm.path).stem, str(llm.path)}:
            raise APIError(404, f"model {name!r} not found (this server runs {self.model_id!r})", param="model",
                           code="model_not_found")

    def health(self) -> tuple[int, str]:
        if self.llm is None or self.scheduler is None:
            return 503, "error" if self.load_error else "loading"
        return 200, "ok"


class JSONBodies:
    """Reads every POST body as JSON whatever its Content-Type, as llama.cpp's server does
    (`curl -d` sends form encoding)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def create_app(llm: LLM | Callable[[], LLM], parallel: int = 1,
               on_load_error: Callable[[Exception], None] | None = None, *, replica: str | None = None) -> FastAPI:
    """The server app over `llm` (or a function that loads it), with `parallel` KV-cache slots.

    `replica`: this app's name among several serving the same model: every answer carries it in
    an x-powerinfer-replica header, and /metrics labels its series with it.
    """
    if parallel < 1:
        raise PowerInferError("parallel must be >= 1")
    state = ServerState(parallel)

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
        if isinstance(llm, LLM):
            state.start(llm)
        else:
            threading.Thread(target=load, args=(llm,), name="powerinfer-load", daemon=True).start()
        yield
        if state.scheduler is not None:
            state.scheduler.close()

    app = FastAPI(title="powerinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(JSONBodies)
    if replica is not None:
        app.add_middleware(ReplicaHeader, name=replica)
    install_handlers(app)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the connection is closed

    @app.get("/health")
    async def health() -> JSONResponse:
        status, word = state.health()
        return JSONResponse({"status": word}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        _, scheduler = state.ready()
        text = prometheus(scheduler)
        if replica is not None:
            text = label_series(text, REPLICA_LABEL, replica)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        llm, _ = state.ready()
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.started,
                                            "owned_by": "powerinfer", "meta": {"n_ctx": llm.n_ctx,
                                                                               "n_vocab": llm.config.n_vocab}}]}

    @app.post("/tokenize")
    async def tokenize(body: schemas.TokenizeRequest) -> dict:
        llm, _ = state.ready()
        return {"tokens": llm.tokenize(body.content, add_bos=body.add_special)}

    @app.post("/detokenize")
    async def detokenize(body: schemas.DetokenizeRequest) -> dict:
        llm, _ = state.ready()
        bad = [t for t in body.tokens if t >= llm.config.n_vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range (vocabulary of {llm.config.n_vocab})", param="tokens")
        return {"content": llm.detokenize(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        llm, scheduler = state.ready()
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        sequence = llm.new_sequence(body.single_prompt(), max_tokens, body.stops(), **body.sampling())
        generation = Generation(scheduler, sequence)
        reply = OpenAIReply("text_completion", state.model_id, chat=False)
        if body.stream:
            return streaming(reply.stream(generation, include_usage=_usage_wanted(body)))
        return JSONResponse(reply.whole(await generation.result(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatRequest, request: Request) -> Response:
        state.check_model(body.model)
        llm, scheduler = state.ready()
        ids = llm.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages])
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sequence = llm.new_sequence(ids, llm.n_ctx if limit is None else limit, body.stops(), **body.sampling())
        generation = Generation(scheduler, sequence)
        reply = OpenAIReply("chat.completion", state.model_id, chat=True)
        if body.stream:
            return streaming(reply.stream(generation, include_usage=_usage_wanted(body)))
        return JSONResponse(reply.whole(await generation.result(request)))

    @app.post("/completion")
    async def llama_completion(body: schemas.LlamaCompletionRequest, request: Request) -> Response:
        llm, scheduler = state.ready()
        max_tokens = llm.n_ctx if body.n_predict < 0 else body.n_predict
        generation = Generation(scheduler, llm.new_sequence(body.prompt, max_tokens, body.stops(), **body.sampling()))
        if body.stream:
            return streaming(llama_stream(generation, state.model_id))
        completion = await generation.result(request)
        return JSONResponse({"content": completion.text, **llama_final(generation.sequence, completion, state.model_id)})

    return app


def streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def _usage_wanted(body: schemas.OpenAIRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage
