"""Log lines stay short whatever clients send: every value a record formats is capped (690k unknown
keys in a body once made one 6 MB line per request)."""

from __future__ import annotations

import logging
import traceback
from numbers import Number

MAX_LOGGED_CHARS = 300
TRACEBACK_FRAMES = 20  # the innermost ones: a RecursionError's thousand frames repeat themselves


def capped(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def cap_log_values() -> None:
    """From now on, every log record's arguments are capped (numbers kept as they are, for %d)."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "caps_values", False):
        return

    def capping(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if isinstance(record.args, tuple):
            record.args = tuple(value if isinstance(value, Number) else capped(str(value)) for value in record.args)
        elif isinstance(record.args, dict):
            record.args = {key: value if isinstance(value, Number) else capped(str(value))
                           for key, value in record.args.items()}
        return record

    capping.caps_values = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(capping)


def failure_text(error: BaseException) -> str:
    """An unexpected error for the log: its type, capped message and innermost frames."""
    frames = "".join(traceback.format_tb(error.__traceback__, limit=-TRACEBACK_FRAMES))
    return f"{type(error).__name__}: {capped(str(error))}\n{frames}"
