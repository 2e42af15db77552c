"""Directories of sparsity artefacts, written so that nothing is ever left half-way."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from powerinfer.errors import PowerInferError


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """A temporary directory next to `target` that replaces it only if the block completes."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise PowerInferError(f"cannot create {target.parent}: {error.strerror}") from None
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        yield staging
        if target.exists():
            retired = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old."))
            target.rename(retired / target.name)
            staging.rename(target)
            shutil.rmtree(retired)
        else:
            staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
