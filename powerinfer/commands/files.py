"""The files commands read and write: text read in one line's error, outputs replaced only with --force."""

from __future__ import annotations

import argparse
from pathlib import Path

from powerinfer.errors import PowerInferError


def read_text(path: str) -> str:
    """A text file's contents, or one line saying why it cannot be read."""
    try:
        return Path(path).read_text()
    except IsADirectoryError:
        raise PowerInferError(f"{path} is a directory, not a text file") from None
    except UnicodeDecodeError:
        raise PowerInferError(f"{path} is not UTF-8 text") from None
    except OSError as error:
        raise PowerInferError(f"cannot read {path}: {error.strerror or error}") from None


def add_force_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output (in a folder, only the files this command writes)")
