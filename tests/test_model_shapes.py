"""Tensors whose shapes do not fit the model's configuration are refused at load, in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from powerinfer import LLM
from powerinfer.convert.model import gguf_source
from powerinfer.errors import ModelFileError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf

from helpers import assert_one_line_error, powerinfer


@pytest.fixture(scope="module")
def tiny(tiny_relu) -> Path:
    return tiny_relu("f32")


def rewrite(source: Path, target: Path, change: dict[str, np.ndarray | None]) -> Path:
    """`source` (a float32 GGUF) with the tensors in `change` replaced (None: left out)."""
    model = gguf_source(source)
    tensors = []
    for name, tensor in open_gguf(source).tensors.items():
        data = change.get(name, tensor.data)
        if data is not None:
            tensors.append(TensorData(name, np.ascontiguousarray(data, dtype=np.float32), T.F32))
    write_gguf(target, model.architecture, {}, tensors, typed_metadata=model.typed_metadata)
    return target


def original(path: Path, name: str) -> np.ndarray:
    return np.asarray(open_gguf(path).tensor(name).data)


CASES = {
    "attn_q halved": ("blk.0.attn_q.weight", lambda w: w[: w.shape[0] // 2], "blk.0.attn_q.weight has shape 32x64"),
    "short embedding": ("token_embd.weight", lambda w: w[:1000], "token_embd.weight has shape 1000x64"),
    "norm too narrow": ("blk.1.ffn_norm.weight", lambda w: w[:7], "blk.1.ffn_norm.weight has shape 7"),
    "down transposed": ("blk.0.ffn_down.weight", lambda w: w.T, "blk.0.ffn_down.weight has shape 160x64"),
    "missing up": ("blk.1.ffn_up.weight", lambda w: None, "tensor blk.1.ffn_up.weight is missing"),
}


@pytest.mark.parametrize("case", CASES)
def test_shapes_that_do_not_fit_the_config_are_refused(tiny, tmp_path, case):
    name, change, message = CASES[case]
    bad = rewrite(tiny, tmp_path / "bad.gguf", {name: change(original(tiny, name))})
    with pytest.raises(ModelFileError, match=message):
        LLM(bad, n_ctx=32)
    assert_one_line_error(powerinfer("run", "-m", str(bad), "-p", "hi", "-n", "1"), message)


def test_an_unchanged_rewrite_loads(tiny, tmp_path):
    same = rewrite(tiny, tmp_path / "same.gguf", {})
    assert LLM(same, n_ctx=32).generate("hi", max_tokens=4, temperature=0) == \
        LLM(tiny, n_ctx=32).generate("hi", max_tokens=4, temperature=0)
