"""Paths as users type them."""

from __future__ import annotations

import os
from pathlib import Path


def user_path(text: str | os.PathLike[str]) -> Path:
    """`text` with ~ and ~USER expanded; a ~USER this machine does not have stays as written (and so
    is no such file) rather than raising pathlib's RuntimeError."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        return Path(text)
