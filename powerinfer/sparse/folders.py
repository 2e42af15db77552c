"""Files of PowerInfer's sparsity folders (predictors, activation statistics), read with one-line
errors: they come from users and other tools, and may be anything."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from powerinfer.errors import PowerInferError


def numbered_files(folder: Path, prefix: str) -> list[Path]:
    """`prefix_0.pt` .. `prefix_{n-1}.pt` in `folder`, in order; an error if none or one is missing."""
    pattern = re.compile(rf"{re.escape(prefix)}_(\d+)\.pt")
    numbered = sorted((int(m.group(1)), path) for path in folder.glob(f"{prefix}_*.pt")
                      if (m := pattern.fullmatch(path.name)))
    if not numbered:
        raise PowerInferError(f"{folder}: no {prefix}_*.pt files")
    if [n for n, _ in numbered] != list(range(len(numbered))):
        raise PowerInferError(f"{folder}: the files are not {prefix}_0.pt .. {prefix}_{len(numbered) - 1}.pt")
    return [path for _, path in numbered]


def load_torch_file(path: Path) -> Any:
    """`torch.load` of tensors only (never code), with a damaged or foreign file as one line."""
    try:
        with warnings.catch_warnings():  # torch warns about the odd pickles it then refuses anyway
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types, with long messages, for a bad file
        raise PowerInferError(f"{path}: not a PyTorch file of tensors, or damaged ({type(error).__name__})") from None


def load_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file does not exist."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PowerInferError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(value, dict):
        raise PowerInferError(f"{path}: expected a JSON object")
    return value
