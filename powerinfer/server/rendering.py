"""JSON answers rendered in a worker thread, in short steps.

An answer can grow with its request: `/tokenize` of an 8 MB text is millions of ids, and an
embeddings answer is thousands of floats per input. FastAPI encodes a route's dict on the event
loop (`jsonable_encoder`: about 4 us per value, 5 s for a million ids), and `json.dumps` of the
whole answer, in whichever thread, is one call that holds the interpreter's lock throughout. Here
lists of plain values are rendered a slice at a time, so the lock passes to the event loop between
slices however large the answer.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

SLICE = 4096  # values of one list rendered per call into C
PLAIN = (str, int, float, bool, type(None))


def _dumps(value: Any) -> str:
    # Starlette's JSONResponse's settings, so that answers read the same as its
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def rendered(value: Any) -> bytes:
    """`value` (dicts, lists and plain values) as Starlette's JSONResponse renders it."""
    parts: list[str] = []
    pending: list[Any] = [value]  # values to render, and text to emit as is (wrapped in a tuple)
    while pending:
        item = pending.pop()
        if isinstance(item, tuple):
            parts.append(item[0])
        elif isinstance(item, dict) and item and all(isinstance(key, str) for key in item):
            entries: list[Any] = []
            for index, (key, inner) in enumerate(item.items()):
                entries += [(("," if index else "{") + _dumps(key) + ":",), inner]
            pending += [("}",), *reversed(entries)]
        elif isinstance(item, list) and item and all(isinstance(inner, PLAIN) for inner in item):
            slices = (_dumps(item[start : start + SLICE])[1:-1] for start in range(0, len(item), SLICE))
            parts.append("[" + ",".join(slices) + "]")
        elif isinstance(item, list) and item:
            entries = []
            for index, inner in enumerate(item):
                entries += [("," if index else "[",), inner]
            pending += [("]",), *reversed(entries)]
        else:  # a plain value, an empty container, or a dict json.dumps must convert the keys of
            parts.append(_dumps(item))
    return "".join(parts).encode("utf-8")


async def json_answer(value: Any, status_code: int = 200) -> Response:
    """An answer holding `value` as JSON, rendered in a worker thread."""
    return Response(await run_in_threadpool(rendered, value), status_code=status_code, media_type="application/json")
