"""Helpers the test modules share (fixtures live in conftest.py): running the CLI, reading its
errors, engines over small models, random tensors and neuron stores, reading PowerInfer GGUFs back."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch
import uvicorn
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants

from powerinfer.gguf import open_gguf
from powerinfer.gguf.reader import PWRI_MAGIC, GGUFTensor
from powerinfer.models import load_model, read_config
from powerinfer.options import FFNOptions
from powerinfer.placement.costs import dense_parts, model_shape
from powerinfer.placement.gpu_index import index_path, write_gpu_index
from powerinfer.placement.solver import Plan
from powerinfer.runtime.engine import Engine
from powerinfer.server.connections import ConnectionLimits, server_config
from powerinfer.server.startup import listen
from powerinfer.sparse import neurons as N

from conftest import quantized_rows

# the quantized types of GGUF blocks our kernels and neuron records keep compact
BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


# A chat question whose reply the default model is sure of on every instruction set: its first token
# leads by over a logit ("Which city is the capital of France?" leads by 0.08, and AVX2's int8
# activations answer that one otherwise).
CAPITAL_QUESTION = "What is the capital city of France? Answer in one word."


# ---------------------------------------------------------------- the command line

def powerinfer(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "powerinfer.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


# ---------------------------------------------------------------- engines and logits

def activation_rounding_factor() -> float:
    """How much coarser than bfloat16 the active kernels round activations (native.activation_rounding):
    a step of int8 per 32 inputs is up to 2^-7 of a block's largest input, bfloat16's 2^-9 of each;
    tolerances measured with bfloat16 scale by this."""
    from powerinfer.ops import native

    return 4.0 if native.load() is not None and native.activation_rounding() == "int8" else 1.0


def plain_and_vnni_avx2(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layer(x) on the AVX2 kernels without and with AVX-VNNI (a CPU that has it)."""
    from powerinfer.ops import native

    with native.kernel_path("avx2"):
        plain = layer(x)
    with native.kernel_path("avx2+vnni"):
        vnni = layer(x)
    return plain, vnni


def engine(path, n_ctx: int = 128, **options) -> Engine:
    """An engine over the model at `path`, built with FFNOptions(**options), with a float32 KV cache:
    its users compare paths at float32 rounding, which a float16 cache's rounding would hide."""
    return Engine(load_model(open_gguf(path), n_ctx, FFNOptions(**options)), n_ctx, cache_type="f32")


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    logits = engine.prefill(0, prompt)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine.decode([(0, out[-1])])[0]
    return out


def decode_logits(e: Engine, ids: list[int], prompt: int = 6) -> torch.Tensor:
    """Logits of a `prompt`-token prefill, then of one decode step per remaining id."""
    rows = [e.prefill(0, ids[:prompt])]
    rows += [e.decode([(0, t)])[0] for t in ids[prompt:]]
    return torch.stack(rows)


def decode_and_prefill_logits(model, ids: list[int], n_ctx: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode logits after a 4-token prompt, logits of one prefill of all ids: the dense path)."""
    e = Engine(model, n_ctx)
    rows = [e.prefill(0, ids[:4])] + [e.decode([(0, t)])[0] for t in ids[4:]]
    return torch.stack(rows), Engine(model, n_ctx).all_logits(ids)


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


# ---------------------------------------------------------------- placement

def place_everything(path: Path, accelerator: str = "cpu", n_ctx: int = 64) -> float:
    """Write a GPU index putting every neuron on an accelerator of type `accelerator`; return a
    budget (GiB) that covers it and all dense parts."""
    gguf = open_gguf(path)
    config = read_config(gguf)
    shape = model_shape(gguf, config, accelerator)
    write_gpu_index(index_path(path), Plan(tuple(np.arange(n, dtype=np.int32) for n in shape.n_ff), shape.n_ff,
                                           shape.ffn_bytes, shape.ffn_bytes, None, None, None, None))
    return (dense_parts(gguf, config, n_ctx).total + shape.ffn_bytes) / 2**30


# ---------------------------------------------------------------- random tensors and neuron stores

def random_tensor(rng, rows, cols, ggml_type) -> tuple[GGUFTensor, torch.Tensor]:
    """A [rows, cols] tensor of `ggml_type` with random values, and its float32 dequantization."""
    if ggml_type in BLOCK_TYPES:
        t = quantized_rows(ggml_type, rows, cols, int(rng.integers(2**16)))
        return t, torch.from_numpy(quants.dequantize(t.data, ggml_type).astype(np.float32))
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = w if ggml_type == T.F32 else w.astype(np.float16)
    return GGUFTensor("w", ggml_type, (rows, cols), raw), torch.from_numpy(raw.astype(np.float32))


def random_store(seed, ggml_type, n_ff, d_in, d_out, gated=True):
    """A NeuronStore of random gate (when `gated`), up and transposed down rows, and their float32 weights."""
    rng = np.random.default_rng(seed)
    (g, gw), (u, uw), (dt, dw) = (random_tensor(rng, n_ff, d_in, ggml_type), random_tensor(rng, n_ff, d_in, ggml_type),
                                  random_tensor(rng, n_ff, d_out, ggml_type))
    return N.NeuronStore(g if gated else None, u, dt), (gw if gated else None, uw, dw)


# ---------------------------------------------------------------- files

def read_back_powerinfer_gguf(path: Path, tmp_path: Path) -> GGUFReader:
    """The file as the `gguf` package reads it (PWRI magic patched to GGUF's on a copy)."""
    copy = tmp_path / f"{path.name}.copy"
    shutil.copy(path, copy)
    with open(path, "rb") as f:
        assert int.from_bytes(f.read(4), "little") == PWRI_MAGIC
    with open(copy, "r+b") as f:
        f.write(b"GGUF")
    return GGUFReader(copy)


# ---------------------------------------------------------------- the HTTP server

PARALLEL = 4  # the KV-cache slots of the test server (conftest's `server` fixture)


class ServerThread:
    """uvicorn serving `app` on a free loopback port from a background thread; with `limits`, under
    our connection limits (server_config), as `serve` runs it."""

    def __init__(self, app, limits: ConnectionLimits | None = None):
        sock = listen("127.0.0.1", 0)
        self.address = sock.getsockname()[:2]
        self.url = f"http://127.0.0.1:{self.address[1]}"
        config = uvicorn.Config(app, log_level="warning") if limits is None else server_config(app, limits, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def serve_command(*args: str, code: str | None = None) -> subprocess.Popen:
    """`powerinfer serve ARGS` in a child process (run by `code`, which calls the CLI, when given)."""
    launcher = ["-c", code] if code else ["-m", "powerinfer.cli"]
    return subprocess.Popen([sys.executable, *launcher, "serve", *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def serving_url(process: subprocess.Popen) -> str:
    """The URL a serve process prints, once its /health says the model is loaded."""
    url = re.search(r"listening on (http://\S+)", process.stderr.readline()).group(1)
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return url
