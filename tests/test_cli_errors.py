"""Every command answers a bad path, directory or file with one line on stderr and exit status 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from powerinfer.cli import main

# ~USER of a user this machine does not have: pathlib's expanduser raises RuntimeError for it.
NO_SUCH_USER_PATH = "~powerinfer-no-such-user/model.gguf"


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, str]:
    """A missing path, a directory, a file that is not what it claims, and damaged .pt folders."""
    root = tmp_path_factory.mktemp("bad")
    (root / "folder").mkdir()
    (root / "text.gguf").write_text("definitely not a model")
    (root / "binary.txt").write_bytes(b"\xff\xfe\x00 not utf-8")
    corrupt = root / "corrupt"
    (corrupt / "activation").mkdir(parents=True)
    (corrupt / "activation" / "activation_0.pt").write_bytes(b"junk, not a torch file")
    (corrupt / "model_0.pt").write_bytes(b"junk, not a torch file")
    wrong = root / "wrong"
    (wrong / "activation").mkdir(parents=True)
    torch.save({"not": "a tensor"}, wrong / "activation" / "activation_0.pt")
    return {"missing": str(root / "missing.gguf"), "folder": str(root / "folder"), "text": str(root / "text.gguf"),
            "binary": str(root / "binary.txt"), "corrupt": str(corrupt), "wrong": str(wrong), "out": str(root / "out"),
            "unknown user": NO_SUCH_USER_PATH}


def model_commands(model: str, out: str, text_file: str) -> list[list[str]]:
    return [
        ["run", "-m", model, "-p", "hi"],
        ["chat", "-m", model],
        ["bench", "-m", model, "-p", "4", "-n", "1", "-r", "1"],
        ["serve", "-m", model, "--port", "0"],
        ["perplexity", "-m", model, "-f", text_file],
        ["profile", "-m", model, "-f", text_file, "-o", out],
        ["train-predictors", "-m", model, "-f", text_file, "-o", out],
        ["convert", model, "--outfile", out + ".gguf"],
        ["quantize", model, out + ".gguf", "Q4_0"],
        ["place", "-m", model, "--vram-budget", "1"],
    ]


def assert_one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"powerinfer {argv[0]}: error: ")
    return err[0]


@pytest.mark.parametrize("kind, fragment", [("missing", "no such file"), ("folder", "is a directory"),
                                            ("text", "not a GGUF file"), ("unknown user", "no such file")])
@pytest.mark.parametrize("index", range(10))
def test_bad_model_file(bad, kind, fragment, index, tmp_path, capsys):
    text_file = tmp_path / "t.txt"
    text_file.write_text("some calibration text " * 20)
    argv = model_commands(bad[kind], bad["out"], str(text_file))[index]
    message = assert_one_line_error(argv, capsys)
    assert fragment in message or (argv[0] == "convert" and kind == "folder" and "no config.json" in message)


@pytest.mark.parametrize("kind, fragment", [("missing", "No such file"), ("folder", "is a directory"),
                                            ("binary", "not UTF-8 text")])
@pytest.mark.parametrize("command", ["run", "chat", "perplexity", "profile", "train-predictors"])
def test_bad_text_file(default_model, bad, kind, fragment, command, capsys):
    argv = [command, "-m", str(default_model), "-f", bad[kind]]
    argv += ["-o", bad["out"]] if command in ("profile", "train-predictors") else []
    assert fragment in assert_one_line_error(argv, capsys)


@pytest.mark.parametrize("kind, fragment", [
    ("missing", "not found|no activation_|no model_"), ("text", "not found|no activation_|no model_"),
    ("folder", "no activation_|no model_"),
    ("corrupt", "not a PyTorch file of tensors, or damaged"),
    ("wrong", "not a tensor of firing counts|no model_"),
])
@pytest.mark.parametrize("command", ["inspect", "place", "convert", "run"])
def test_bad_statistics_and_predictor_folders(default_model, bad, kind, fragment, command, capsys):
    model = str(default_model)
    argv = {
        "inspect": ["inspect", "--activations", bad[kind], "-o", bad["out"] + ".png"],
        "place": ["place", "-m", model, "--vram-budget", "1", "--activations", bad[kind]],
        "convert": ["convert", model, bad[kind], "--outfile", bad["out"] + ".gguf"],
        "run": ["run", "-m", model, "-p", "hi", "-n", "1", "--vram-budget", "1", "--activations", bad[kind],
                "--accelerator", "cpu"],
    }[command]
    assert re.search(fragment, assert_one_line_error(argv, capsys))


def test_damaged_profile_json(tmp_path, capsys):
    (tmp_path / "activation").mkdir()
    torch.save(torch.ones(4), tmp_path / "activation" / "activation_0.pt")
    (tmp_path / "activation" / "profile.json").write_text("{not json")
    argv = ["inspect", "--activations", str(tmp_path), "-o", str(tmp_path / "a.png")]
    assert "not readable JSON" in assert_one_line_error(argv, capsys)


@pytest.mark.parametrize("command", ["profile", "train-predictors"])
def test_calibration_outputs_and_tokens_are_checked_before_the_model_loads(tmp_path, command, capsys):
    """The model is missing too: an answer about the output or --tokens came before any loading."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    missing_model = str(tmp_path / "none.gguf")
    text = str(Path(__file__).parent / "data" / "wikitext-2" / "valid.txt")
    message = assert_one_line_error([command, "-m", missing_model, "-f", text, "-o", str(blocker / "out")], capsys)
    assert f"{blocker} is not a folder" in message
    message = assert_one_line_error([command, "-m", missing_model, "-f", text, "-o", str(tmp_path / "out"),
                                     "--tokens", "10"], capsys)
    assert "--tokens 10: calibration needs at least" in message


def test_chat_template_of_an_unknown_user_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "-p", "hi", "--chat-template", NO_SUCH_USER_PATH])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert f"chat template '{NO_SUCH_USER_PATH}' is neither a built-in" in err[0]

