"""Models named by Hugging Face repo id, resolved through a Hugging Face cache built by hand.

The hub is unreachable here, so each test lays out the cache as huggingface_hub writes it
(models--ORG--NAME/{refs/main, blobs/, snapshots/<rev>/}) and checks what huggingface_hub itself
finds there.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from powerinfer.errors import ModelFileError, PowerInferError
from powerinfer.hub import hf_model_path, looks_like_hf_repo, resolve_model

REPO = "someone/Tiny-GGUF"
FILES = ["tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "tiny-Q8_0.gguf", "mmproj-tiny-f16.gguf", "README.md"]


def cache_repo(cache: Path, repo: str, files: dict[str, bytes | Path], revision: str = "a" * 40) -> Path:
    """Lay out `repo` in a Hugging Face cache folder; a Path value becomes a blob linking to it."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    snapshot = folder / "snapshots" / revision
    for name, content in files.items():
        blob = folder / "blobs" / hashlib.sha256(name.encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            blob.symlink_to(content.resolve())
        else:
            blob.write_bytes(content)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache that huggingface_hub uses, in offline mode."""
    import huggingface_hub.constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.parametrize("spec, expected", [
    (REPO, "tiny-Q4_K_M.gguf"),  # llama.cpp's default quant
    (f"{REPO}:Q8_0", "tiny-Q8_0.gguf"),
    (f"{REPO}:q8_0", "tiny-Q8_0.gguf"),  # the tag is case-insensitive
    (f"{REPO}:Q4_K_S", "tiny-Q4_K_S.gguf"),
])
def test_quant_tag_picks_the_file(hf_cache, spec, expected):
    snapshot = cache_repo(hf_cache, REPO, {name: b"x" for name in FILES})
    assert hf_model_path(spec) == snapshot / expected
    assert resolve_model(spec) == snapshot / expected  # -m takes the same


def test_hf_file_names_the_file(hf_cache):
    snapshot = cache_repo(hf_cache, REPO, {name: b"x" for name in FILES})
    assert hf_model_path(f"{REPO}:Q8_0", "tiny-Q4_K_S.gguf") == snapshot / "tiny-Q4_K_S.gguf"
    assert resolve_model(REPO, hf_file="tiny-Q8_0.gguf") == snapshot / "tiny-Q8_0.gguf"


def test_a_single_gguf_needs_no_tag(hf_cache):
    snapshot = cache_repo(hf_cache, REPO, {"model.gguf": b"x", "mmproj-model.gguf": b"x"})
    assert hf_model_path(REPO) == snapshot / "model.gguf"


@pytest.mark.parametrize("spec, fragment", [
    (f"{REPO}:Q4_K", "matches several files"),  # Q4_K_M and Q4_K_S
    (f"{REPO}:Q5_K_M", "no .gguf with 'Q5_K_M' in its name in the Hugging Face cache (offline)"),
    ("someone/not-cached", "no .gguf files"),
    ("not a repo", "not a Hugging Face repo id"),
])
def test_choices_that_fail_say_why(hf_cache, spec, fragment):
    cache_repo(hf_cache, REPO, {name: b"x" for name in FILES})
    with pytest.raises(PowerInferError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        hf_model_path(spec)


def test_hf_file_not_cached_offline(hf_cache):
    cache_repo(hf_cache, REPO, {name: b"x" for name in FILES})
    with pytest.raises(PowerInferError, match="not in the Hugging Face cache .* and offline"):
        hf_model_path(REPO, "tiny-Q6_K.gguf")


def test_paths_stay_paths(tmp_path):
    local = tmp_path / "org" / "model"
    local.parent.mkdir()
    local.write_bytes(b"x")
    assert resolve_model(str(local)) == local
    assert looks_like_hf_repo("org/name") and looks_like_hf_repo("org/name:Q4_0")
    assert not looks_like_hf_repo("models/model.gguf") and not looks_like_hf_repo("/abs/org/name")
    with pytest.raises(PowerInferError, match="--hf-file needs a Hugging Face repo"):
        resolve_model(None, hf_file="x.gguf")


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "powerinfer.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


@pytest.fixture
def cached_default_model(tmp_path, default_model):
    """The default model as a Hugging Face repo in a fresh cache: (cache folder, snapshot path)."""
    cache = tmp_path / "hf-cache"
    snapshot = cache_repo(cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
                          {"smollm2-135m-instruct-q4_1.gguf": default_model, "smollm2-135m-instruct-q8_0.gguf": b"x"})
    return cache, snapshot


def test_run_from_the_cache_without_a_network(cached_default_model, default_llm):
    """Not in offline mode, with an endpoint nothing listens on: a cached file needs no network."""
    cache, _ = cached_default_model
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    result = cli("run", "-hf", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1", "-p", "The capital of France is",
                 "-n", "8", "--temp", "0", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == default_llm.generate("The capital of France is", max_tokens=8, temperature=0)


def test_pull_offline_prints_the_cached_path(cached_default_model):
    cache, snapshot = cached_default_model
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    result = cli("pull", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:q4_1", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(snapshot / "smollm2-135m-instruct-q4_1.gguf")
    result = cli("pull", "-hf", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "--hf-file", "smollm2-135m-instruct-q8_0.gguf",
                 env=env)
    assert result.returncode == 0 and result.stdout.strip() == str(snapshot / "smollm2-135m-instruct-q8_0.gguf")


@pytest.mark.parametrize("args, fragment", [
    (["run", "-m", "someone/missing:Q4_0", "-p", "hi"], "someone/missing has no .gguf files in the Hugging Face cache (offline)"),
    (["run", "-hf", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q2_K", "-p", "hi"], "no .gguf with 'Q2_K' in its name"),
    (["pull", "someone/missing", "--hf-file", "m.gguf"], "someone/missing/m.gguf is not in the Hugging Face cache"),
])
def test_missing_from_the_cache_offline_is_one_line(cached_default_model, args, fragment):
    cache, _ = cached_default_model
    result = cli(*args, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and fragment in result.stderr, result.stderr


@pytest.mark.parametrize("model", ["./models/smollm", "../smollm", "/nowhere/smollm", "~/nowhere-powerinfer/smollm",
                                   "smollm.gguf", "org/name.GGUF", "models/org/name", "."])
def test_what_looks_like_a_path_is_a_file(model):
    assert not looks_like_hf_repo(model)


def test_a_missing_file_is_reported_at_once(tmp_path, monkeypatch):
    """`models/smollm` in a folder that has models/ is a mistyped file, never a repo to look up."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert not looks_like_hf_repo("models/smollm") and looks_like_hf_repo("elsewhere/smollm")
    for model in ("models/smollm", "./smollm", "smollm.gguf", "~/nowhere-powerinfer/x.gguf"):
        with pytest.raises(ModelFileError, match=f"{model}: no such file"):
            resolve_model(model)


def refused_endpoint() -> str:
    """A loopback URL nothing listens on (the port was just free), so connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("spec, hf_file", [("someone/not-cached:Q4_0", None), ("someone/not-cached", "m.gguf")])
def test_an_uncached_repo_without_a_network_fails_within_3_s(hf_cache, monkeypatch, spec, hf_file):
    """Not offline by setting, but the hub refuses connections: one error, not huggingface_hub's
    25 s of retries."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", refused_endpoint())
    started = time.monotonic()
    with pytest.raises(PowerInferError, match=r"the Hugging Face cache .*the hub \(http://127.0.0.1:\d+\) cannot be reached"):
        hf_model_path(spec, hf_file)
    assert time.monotonic() - started < 3


@pytest.mark.parametrize("args", [["run", "-m", "someone/not-cached", "-p", "hi"],
                                  ["run", "-hf", "someone/not-cached:Q8_0", "-p", "hi"],
                                  ["pull", "someone/not-cached"]])
def test_an_uncached_repo_without_a_network_is_one_line(tmp_path, args):
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    env.update(HF_HUB_CACHE=str(tmp_path), HF_ENDPOINT=refused_endpoint())
    result = subprocess.run([sys.executable, "-m", "powerinfer.cli", *args], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot be reached" in lines[0] and "Retrying" not in result.stderr, result.stderr
