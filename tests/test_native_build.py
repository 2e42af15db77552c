"""The native operators come compiled with the package: nothing is built at run time, a torch the
module was not built for gets one line and the plain-torch fallback, and an interrupted load leaves
nothing behind that blocks the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import powerinfer
from powerinfer.ops import native


def run_python(code: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def test_installed_package_holds_the_compiled_module(tmp_path):
    """The module lies inside the installed package, and loading it compiles nothing (torch's
    extension builder would write into TORCH_EXTENSIONS_DIR)."""
    code = ("import sys; from powerinfer.ops import native; m = native.load(); "
            "print(m.__file__ if m else None); print('torch.utils.cpp_extension' in sys.modules)")
    result = run_python(code, timeout=120, TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    module_file, builder_imported = result.stdout.split()
    assert Path(module_file).parent == Path(powerinfer.__file__).parent
    assert Path(module_file).name.startswith("_native") and Path(module_file).suffix == ".so"
    assert builder_imported == "False" and not any(tmp_path.iterdir())
    assert result.stderr == ""


def test_module_built_for_another_torch_gives_one_line_and_the_fallback(monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    assert native.import_compiled() is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "built for torch" in lines[0] and "2.99.0+cpu" in lines[0] and "reinstall powerinfer" in lines[0]


def test_missing_build_record_gives_one_line_and_the_fallback(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(native, "PACKAGE_DIR", tmp_path)
    assert native.import_compiled() is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "reinstall powerinfer" in lines[0]


@pytest.mark.slow
def test_load_killed_midway_then_loaded_again_finishes(default_model):
    """A run interrupted while loading (as Ctrl-C or a timeout does) must not leave a lock or a
    half-built file that makes the next run wait."""
    loader = f"from powerinfer import LLM; print('loading', flush=True); LLM({str(default_model)!r}, n_ctx=64); print('loaded', flush=True)"
    # the killed child waits after loading: the kill lands even where loading takes less than the pause
    child = subprocess.Popen([sys.executable, "-c", loader + "; import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "loading"
        time.sleep(0.1)  # inside LLM(): the native module and the weights are being loaded
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    again = run_python(loader, timeout=90)  # a hang (the old build lock) would run into the timeout
    assert again.returncode == 0 and again.stdout.split() == ["loading", "loaded"], again.stderr
