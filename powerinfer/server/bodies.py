"""JSON request bodies parsed and validated in worker threads, their values counted first.

FastAPI parses and validates a body on the event loop: while it works through a large body, no
other client is answered. Here that work runs in a thread. A thread alone is not enough: the
interpreter's lock passes between threads only between calls into C, and `json.loads` of an 8 MB
body of small values is one call of about half a second, which the event loop would wait out. So the
body's values are counted first by a scan whose every step is a short call (`within_budget`), and
only a body within schemas.MAX_JSON_VALUES reaches `json.loads`: the longest call the event loop
can wait for is then the parse of a body within that budget.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

from anyio import CapacityLimiter, to_thread
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from powerinfer.api.schemas import MAX_JSON_VALUES, TOO_DEEP, TOO_MANY_VALUES
from powerinfer.server.errors import APIError

Model = TypeVar("Model", bound=BaseModel)
# Large bodies parsed at once: parsing holds the interpreter, so more threads would add only memory
# (the body, its text and up to a budget's worth of values each); two, so that one large body does
# not hold up the others. Small bodies take anyio's shared threads: they never wait behind large ones.
BODY_WORKERS = 2
SMALL_BODY = 256 * 1024
STRUCTURE = re.compile(rb'[",:\[{]')  # outside strings: a string's start, or a byte that adds values
STRING_END = re.compile(rb'["\\]')  # inside a string: its end, or an escape
NEXT_TOKEN = re.compile(rb"\S")
QUOTE, BACKSLASH = ord('"'), ord("\\")


def within_budget(raw: bytes, budget: int = MAX_JSON_VALUES) -> bool:
    """Whether the JSON text `raw` holds at most `budget` values, counted as schemas' walk counts
    them (each array item, each object key and value, and the root): 1 + commas + colons + non-empty
    arrays and objects, outside strings. Each step is one short regex search, so the scan passes the
    interpreter to other threads throughout, and stops as soon as the budget is passed."""
    if 1 + sum(raw.count(byte) for byte in (b",", b":", b"[", b"{")) <= budget:  # strings' bytes included
        return True
    counted, position = 1, 0
    while (found := STRUCTURE.search(raw, position)) is not None:
        byte, position = raw[found.start()], found.end()
        if byte == QUOTE:
            while (end := STRING_END.search(raw, position)) is not None and raw[end.start()] == BACKSLASH:
                position = end.end() + 1  # past the escaped byte
            if end is None:  # not JSON: json.loads says where
                return True
            position = end.end()
        elif byte in b"[{" and ((inside := NEXT_TOKEN.search(raw, position)) is None or raw[inside.start()] in b"]}"):
            continue  # empty: holds no values
        else:
            counted += 1
            if counted > budget:
                return False
    return True


def decoded(raw: bytes) -> Any:
    """The JSON value of a body; RequestValidationError (as FastAPI raises it) for one that is not JSON
    or holds more values than the budget."""
    try:
        text = raw.decode("utf-8")  # RFC 8259's only encoding (json.loads would guess UTF-16 from zero bytes)
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not valid UTF-8 ({error.reason} at byte {error.start})") from None
    if not within_budget(raw):
        raise RequestValidationError([{"type": "value_error", "loc": ("body",), "input": {},
                                       "msg": f"Value error, {TOO_MANY_VALUES}"}])
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        problem = {"type": "json_invalid", "loc": ("body", error.pos), "msg": "JSON decode error", "input": {},
                   "ctx": {"error": error.msg}}
    except RecursionError:  # the decoder recurses per level: it gives up long before the stack would
        problem = {"type": "value_error", "loc": ("body",), "msg": f"Value error, {TOO_DEEP}", "input": {}}
    raise RequestValidationError([problem])


def validated(model: type[Model], raw: bytes) -> Model:
    """`raw` as a `model`, or RequestValidationError (as FastAPI raises it, without the inputs)."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    value = decoded(raw)
    try:
        return model.model_validate(value)
    except ValidationError as error:
        problems = [{**problem, "loc": ("body", *problem["loc"])}
                    for problem in error.errors(include_url=False, include_input=False)]
    # Freed here, in this thread: the error raised below must not keep a large value alive until
    # the event loop drops it.
    del value
    raise RequestValidationError(problems)


def json_body(model: type[Model]) -> Any:
    """The type of a route parameter that is the request's body as a `model`, parsed and validated
    off the event loop (a dependency, in place of FastAPI's own body handling)."""

    async def parse(request: Request) -> Model:
        raw = await request.body()
        limiter: CapacityLimiter | None = request.app.state.body_workers if len(raw) > SMALL_BODY else None
        return await to_thread.run_sync(validated, model, raw, limiter=limiter)

    return Annotated[model, Depends(parse)]


def body_workers() -> CapacityLimiter:
    """The limit on large bodies parsed at once, one per app (it binds to the event loop that first uses it)."""
    return CapacityLimiter(BODY_WORKERS)
