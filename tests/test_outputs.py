"""Outputs never overwrite a user's data, never stay half-written, and get the umask's permissions;
bad output paths and damaged input files are one line and exit 2."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from powerinfer.errors import PowerInferError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf
from powerinfer.outputs import OutputExistsError, atomic_directory, check_output_dir, check_output_file
from powerinfer.sparse.predictor_training import PREDICTOR_FILES, TrainedPredictor, load_predictors, save_predictors

from conftest import make_tiny_llama
from helpers import assert_one_line_error, powerinfer


def tiny_model(path: Path) -> Path:
    """A one-layer llama GGUF of random weights, small enough to convert and quantize in a moment."""
    rng = np.random.default_rng(0)
    n_embd, n_ff, n_vocab = 64, 64, 32
    metadata = {"llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": n_embd,
                "llama.feed_forward_length": n_ff, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 4,
                "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [f"t{i}" for i in range(n_vocab)]}
    shapes = {"token_embd.weight": (n_vocab, n_embd), "blk.0.attn_q.weight": (n_embd, n_embd),
              "blk.0.ffn_up.weight": (n_ff, n_embd), "output_norm.weight": (n_embd,)}
    write_gguf(path, "llama", metadata,
               [TensorData(name, rng.standard_normal(shape).astype(np.float32), T.F32) for name, shape in shapes.items()])
    return path


def predictors(n_layers: int) -> list[TrainedPredictor]:
    return [TrainedPredictor(torch.randn(4, 8), torch.randn(16, 4), 0.5) for _ in range(n_layers)]


# -- refusing to overwrite ----------------------------------------------------------------------

def test_checks_refuse_existing_outputs_unless_forced(tmp_path):
    existing = tmp_path / "out.gguf"
    existing.write_text("mine")
    with pytest.raises(OutputExistsError, match="exists; pass --force"):
        check_output_file(existing, force=False)
    assert check_output_file(existing, force=True) == existing
    with pytest.raises(OutputExistsError, match="is a folder"):
        check_output_file(tmp_path, force=True)
    with pytest.raises(PowerInferError, match="does not exist"):
        check_output_file(tmp_path / "no" / "out.gguf", force=True)
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", PREDICTOR_FILES, force=False)
    check_output_dir(tmp_path / "new", PREDICTOR_FILES, force=False)
    with pytest.raises(OutputExistsError, match=r"not empty; pass --force .*model_\*\.pt, config\.json"):
        check_output_dir(tmp_path, PREDICTOR_FILES, force=False)
    with pytest.raises(OutputExistsError, match="not a folder"):
        check_output_dir(existing, PREDICTOR_FILES, force=True)


def test_train_predictors_refuses_a_folder_with_contents(tmp_path, default_model):
    """Issue 16: it used to delete the folder's contents and exit 0."""
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "chapter1.tex").write_text("years of work")
    (folder / "model_0.pt").write_text("not even ours")
    text = tmp_path / "calibration.txt"
    text.write_text("calibration text " * 500)
    result = powerinfer("train-predictors", "-m", str(default_model), "-f", str(text), "-o", str(folder))
    assert_one_line_error(result, str(folder), "not empty", "--force")
    assert sorted(p.name for p in folder.iterdir()) == ["chapter1.tex", "model_0.pt"]
    assert (folder / "chapter1.tex").read_text() == "years of work"


def test_forced_folder_output_replaces_only_our_files(tmp_path):
    folder = tmp_path / "predictors"
    save_predictors(folder, predictors(3))
    (folder / "notes.txt").write_text("keep me")
    save_predictors(folder, predictors(2), replace=True)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model_0.pt", "model_1.pt", "notes.txt"]
    assert len(load_predictors(folder).fc1) == 2  # model_2.pt, ours from the first run, is gone


def test_folder_filled_while_we_worked_is_not_replaced(tmp_path):
    folder = tmp_path / "predictors"
    folder.mkdir()  # empty when the command checked it
    (folder / "late.txt").write_text("arrived meanwhile")
    with pytest.raises(OutputExistsError, match="not empty"):
        save_predictors(folder, predictors(1), replace=False)
    assert [p.name for p in folder.iterdir()] == ["late.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


@pytest.mark.parametrize("command", ["quantize", "convert"])
def test_file_outputs_refuse_to_overwrite_unless_forced(tmp_path, command):
    source = tiny_model(tmp_path / "tiny.gguf")
    target = tmp_path / "out.gguf"
    target.write_text("precious")
    args = [str(source), str(target), "Q8_0"] if command == "quantize" else [str(source), "--outfile", str(target)]
    assert_one_line_error(powerinfer(command, *args), str(target), "exists; pass --force")
    assert target.read_text() == "precious"
    result = powerinfer(command, *args, "--force")
    assert result.returncode == 0, result.stderr
    assert set(open_gguf(target).tensors) == set(open_gguf(source).tensors)


def test_place_output_errors_are_one_line(tmp_path, default_model):
    folder = tmp_path / "index"
    folder.mkdir()
    assert_one_line_error(powerinfer("place", "-m", str(default_model), "--vram-budget", "1", "-o", str(folder)),
                          "is a folder")
    existing = tmp_path / "model.gpuidx"
    existing.write_text("someone's index")
    assert_one_line_error(powerinfer("place", "-m", str(default_model), "--vram-budget", "1", "-o", str(existing)),
                          "exists; pass --force")
    assert existing.read_text() == "someone's index"


# -- bad output paths and damaged inputs --------------------------------------------------------

def test_inspect_bad_outputs_and_damaged_statistics(tmp_path):
    activations = tmp_path / "activation"
    activations.mkdir()
    torch.save(torch.arange(10), activations / "activation_0.pt")
    assert_one_line_error(powerinfer("inspect", "--activations", str(tmp_path), "-o", "/nonexistent/a.png"),
                          "/nonexistent", "does not exist")
    assert_one_line_error(powerinfer("inspect", "--activations", str(tmp_path), "-o", str(tmp_path / "a.xyz")),
                          "unknown image type '.xyz'", "png")
    (activations / "activation_1.pt").write_bytes(b"\x80\x04 not a pickle")
    assert_one_line_error(powerinfer("inspect", "--activations", str(tmp_path), "-o", str(tmp_path / "a.png")),
                          "activation_1.pt", "not a PyTorch file of tensors")
    (activations / "activation_1.pt").unlink()
    result = powerinfer("inspect", "--activations", str(tmp_path), "-o", str(tmp_path / "a.svg"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "a.svg").read_text().lstrip().startswith("<?xml")


def test_damaged_predictor_and_checkpoint_files(tmp_path, default_model):
    source = tiny_model(tmp_path / "tiny.gguf")
    folder = tmp_path / "predictors"
    save_predictors(folder, predictors(1))
    (folder / "model_0.pt").write_bytes(b"PK\x03\x04 cut short")
    assert_one_line_error(powerinfer("convert", str(source), str(folder), "--outfile", str(tmp_path / "o.gguf")),
                          "model_0.pt", "not a PyTorch file of tensors")
    torch.save({"fc1.weight": "text"}, folder / "model_0.pt")
    assert_one_line_error(powerinfer("convert", str(source), str(folder), "--outfile", str(tmp_path / "o.gguf")),
                          "not a predictor state dict")
    checkpoint = tmp_path / "hf"
    make_tiny_llama(checkpoint, "silu", tokenizer_from=default_model)
    config = (checkpoint / "config.json").read_text()
    (checkpoint / "config.json").write_text(config.replace('"num_attention_heads"', '"renamed"'))
    assert_one_line_error(powerinfer("convert", str(checkpoint), "--outfile", str(tmp_path / "o.gguf")),
                          "config.json", "'num_attention_heads' is missing")
    (checkpoint / "config.json").write_text(config)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_one_line_error(powerinfer("convert", str(checkpoint), "--outfile", str(tmp_path / "o.gguf")),
                          "model.safetensors", "not a readable safetensors file")
    assert not (tmp_path / "o.gguf").exists()


# -- permissions and killed writers -------------------------------------------------------------

def test_outputs_honour_the_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        write_gguf(tmp_path / "m.gguf", "llama", {}, [])
        save_predictors(tmp_path / "predictors", predictors(1))
    finally:
        os.umask(previous)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "m.gguf") == 0o640
    assert mode(tmp_path / "predictors") == 0o750
    assert {mode(p) for p in (tmp_path / "predictors").iterdir()} == {0o640}


KILLED_FILE_WRITER = """
import os, signal, sys
import numpy as np
from gguf import GGMLQuantizationType
from powerinfer.gguf.writer import TensorData, write_gguf

def tensors():
    yield TensorData("a", np.zeros(4096, np.float32), GGMLQuantizationType.F32)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of the write

write_gguf(sys.argv[1], "llama", {}, tensors())
"""

KILLED_FOLDER_WRITER = """
import os, signal, sys
from powerinfer.outputs import atomic_directory
from powerinfer.sparse.predictor_training import PREDICTOR_FILES

with atomic_directory(sys.argv[1], PREDICTOR_FILES) as staging:
    (staging / "model_0.pt").write_bytes(b"half")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def run_killed(script: str, target: Path) -> Path:
    """Run a writer that kill -9s itself half-way; return the temporary it left next to `target`."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(target)], capture_output=True)
    assert result.returncode == -signal.SIGKILL, result.stderr
    left = [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.")]
    assert len(left) == 1 and left[0].name.endswith(".part") and not target.exists()
    return left[0]


def test_killed_writer_leftovers_are_removed_by_the_next_run(tmp_path):
    target = tmp_path / "out.gguf"
    run_killed(KILLED_FILE_WRITER, target)
    result = powerinfer("quantize", str(tiny_model(tmp_path / "tiny.gguf")), str(target), "Q8_0")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf", "tiny.gguf"]
    assert open_gguf(target).tensor("blk.0.attn_q.weight").ggml_type == T.Q8_0

    folder = tmp_path / "predictors"
    run_killed(KILLED_FOLDER_WRITER, folder)
    save_predictors(folder, predictors(2))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(load_predictors(folder).fc1) == 2


def test_leftover_of_a_running_process_is_named_not_removed(tmp_path, capfd):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / f".out.gguf.{sleeper.pid}.0123abcd.part"
        busy.write_text("another writer's")
        older = tmp_path / ".out.gguf.k2j4h_x9.part"  # tempfile's naming, before outputs.py
        older.write_text("old")
        write_gguf(tmp_path / "out.gguf", "llama", {}, [])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert busy.exists() and older.exists()
    warnings = capfd.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(line.startswith("powerinfer: warning: ") for line in warnings)
    assert any(str(busy) in line and str(sleeper.pid) in line for line in warnings)
    assert any(str(older) in line for line in warnings)


def test_atomic_directory_leaves_nothing_when_the_block_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "out", PREDICTOR_FILES) as staging:
            (staging / "model_0.pt").write_bytes(b"x")
            raise RuntimeError("writer failed")
    assert list(tmp_path.iterdir()) == []


# -- a forced replacement appears all at once; mixed sets are refused; symlinked folders ----------

KILLED_SWAP_WRITER = """
import os, signal, sys
import torch
from powerinfer.sparse.predictor_training import TrainedPredictor, save_predictors

calls = []
def move_then_die(original):
    def move(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # kill -9 while files are moved into place
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)
    return move
os.replace, os.rename, os.link = (move_then_die(f) for f in (os.replace, os.rename, os.link))
torch.manual_seed(1)
save_predictors(sys.argv[1], [TrainedPredictor(torch.randn(4, 8), torch.randn(16, 4), 0.5) for _ in range(5)])
"""


def test_forced_replacement_killed_midway_leaves_one_whole_set(tmp_path):
    folder = tmp_path / "predictors"
    save_predictors(folder, predictors(3))
    (folder / "notes.txt").write_text("keep me")
    subprocess.run([sys.executable, "-c", KILLED_SWAP_WRITER, str(folder)], capture_output=True, timeout=120)
    names = sorted(p.name for p in folder.iterdir())
    assert names in (["config.json", *[f"model_{i}.pt" for i in range(n)], "notes.txt"] for n in (3, 5))
    assert len(load_predictors(folder).fc1) in (3, 5)  # one run's files, never a mix
    assert (folder / "notes.txt").read_text() == "keep me"


def test_predictor_set_mixed_from_two_runs_is_refused(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    save_predictors(first, predictors(3))
    save_predictors(second, predictors(3))
    (first / "model_1.pt").write_bytes((second / "model_1.pt").read_bytes())
    with pytest.raises(PowerInferError, match="model_1.pt: not the file config.json lists"):
        load_predictors(first)
    (second / "model_2.pt").unlink()
    with pytest.raises(PowerInferError, match="differ from those config.json lists"):
        load_predictors(second)


def test_output_folder_that_is_a_symlink_to_an_empty_folder(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    save_predictors(check_output_dir(link, PREDICTOR_FILES, force=False), predictors(2), replace=False)
    assert link.is_symlink() and sorted(p.name for p in real.iterdir()) == ["config.json", "model_0.pt", "model_1.pt"]
    save_predictors(link, predictors(1), replace=True)  # a forced replacement through the link
    assert link.is_symlink() and len(load_predictors(link).fc1) == 1
