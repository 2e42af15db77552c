"""llama.cpp's flags as its users type them, and flag values checked before any model loads."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from pathlib import Path

import pytest

from powerinfer.cli import main, parse_args
from powerinfer.commands import COMMANDS, command_module
from powerinfer.commands.parsing import MULTI_LETTER_FLAG

MODEL_COMMANDS = ["run", "chat", "bench", "serve", "perplexity", "profile", "train-predictors"]
# llama.cpp's several-letter single-dash flags that we accept, per command, with a value and the
# attribute it must land in: never a shorter flag with the rest glued on as its value.
LLAMA_CPP_FLAGS = {
    **{command: [("-ngl", "99", "n_gpu_layers", 99), ("-ctk", "f32", "cache_type", "f32"),
                 ("-hf", "org/name:Q4_K_M", "hf_repo", "org/name:Q4_K_M"),
                 ("-hfr", "org/name", "hf_repo", "org/name"), ("-hff", "f.gguf", "hf_file", "f.gguf"),
                 ("-fa", "on", "flash_attn", "on"), ("-ub", "64", "ubatch_size", 64),
                 ("-ctv", "f32", "cache_type_v", "f32")]
       for command in MODEL_COMMANDS},
    **{command: [("-hf", "org/name", "hf_repo", "org/name"), ("-hfr", "org/name", "hf_repo", "org/name"),
                 ("-hff", "f.gguf", "hf_file", "f.gguf")] for command in ("place", "pull", "show", "sparsify")},
}
LLAMA_CPP_FLAGS["run"] += [("-cnv", None, "conversation", True), ("-no-cnv", None, "conversation", False),
                           ("-sys", "be brief", "system", "be brief")]
LLAMA_CPP_FLAGS["chat"] += [("-sys", "be brief", "system", "be brief"), ("-cnv", None, "conversation", True)]
LLAMA_CPP_FLAGS["serve"] += [("-np", "2", "parallel", 2), ("-cb", None, "cont_batching", True)]
REQUIRED = {"perplexity": ["-f", "t.txt"], "profile": ["-f", "t.txt", "-o", "out"],
            "train-predictors": ["-f", "t.txt", "-o", "out"], "place": ["--vram-budget", "1"],
            "sparsify": ["-f", "t.txt", "-o", "out"]}


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    return {name: command_module(name).build_parser() for name in COMMANDS}


def parse(*argv: str) -> argparse.Namespace:
    return parse_args(list(argv))


@pytest.mark.parametrize("command, flag, value, dest, expected",
                         [(c, *f) for c, flags in LLAMA_CPP_FLAGS.items() for f in flags])
def test_llama_cpp_flags_are_read_whole(command, flag, value, dest, expected):
    model = [] if flag in ("-hf", "-hfr") or command in ("pull", "show") else ["-m" if command == "place" else "-t", "1"]
    args = parse(command, *model, *REQUIRED.get(command, []), flag, *([value] if value is not None else []))
    assert getattr(args, dest) == expected


def test_every_multi_letter_flag_we_define_is_listed():
    """A new single-dash flag of several letters must join the list above (and so the test)."""
    listed = {(command, flag) for command, flags in LLAMA_CPP_FLAGS.items() for flag, *_ in flags}
    defined = {(command, option) for command, sub in command_parsers().items()
               for option in sub._option_string_actions if MULTI_LETTER_FLAG.fullmatch(option)}
    assert defined == listed


@pytest.mark.parametrize("argv, glued", [
    (["run", "-p", "x", "-nkvo"], "-nkvo"),  # llama.cpp's no-KV-offload: not -n kvo
    (["run", "-p", "x", "-sm", "row"], "-sm"),  # llama.cpp's split mode: not -s m
    (["bench", "-ngld", "3"], "-ngld"),
    (["-hf", "org/name"], "-hf"),  # before the command: not -h f
])
def test_unknown_multi_letter_flags_are_refused_whole(argv, glued, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and f"unknown flag {glued} " in err[0]


def test_glued_numbers_still_work():
    args = parse("run", "-p", "x", "-n128", "-t2")
    assert (args.n_predict, args.threads) == (128, 2)


def test_version(capsys):
    """As llama-cli --version: the build (commit), the instruction set, torch, and CUDA."""
    import subprocess

    import torch

    from powerinfer.ops import native

    with pytest.raises(SystemExit) as exit_info:
        parse("--version")
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    package = Path(__file__).parent.parent / "powerinfer"
    head = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    version, commit = re.fullmatch(r"powerinfer (\S+) \(commit (\w+)\)", lines[0]).groups()
    assert version == importlib.metadata.version("powerinfer") and head.startswith(commit)
    ops = native.load()
    assert lines[1].startswith("native kernels: " + ("unavailable" if ops is None else ops.isa()))
    assert lines[2] == f"torch {torch.__version__}"
    assert lines[3].startswith("CUDA: usable" if torch.cuda.is_available() else "CUDA: not usable")


@pytest.mark.parametrize("flag, value", [
    ("--temp", "-1"), ("--temp", "nan"), ("--top-k", "-1"), ("--top-p", "0"), ("--top-p", "1.5"), ("--min-p", "2"),
    ("--repeat-penalty", "0"), ("--repeat-last-n", "-1"), ("-n", "-2"), ("-c", "0"), ("-t", "0"), ("-s", "-2"),
    ("-ngl", "-1"),
])
def test_bad_values_stop_before_the_model_loads(flag, value, tmp_path, capsys):
    """The model path does not exist: only a parse-time check can answer first."""
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "-m", missing, "-p", "x", flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert f"argument {flag}" in err[0] and "missing.gguf" not in err[0]


def test_good_edge_values_parse():
    args = parse("run", "-p", "x", "--temp", "0", "--top-p", "1", "--min-p", "0", "-n", "-1", "-s", "-1", "-ngl", "0")
    assert (args.temp, args.top_p, args.min_p, args.n_predict, args.seed, args.n_gpu_layers) == (0, 1, 0, -1, -1, 0)


def test_run_needs_a_prompt_unless_it_converses(capsys):
    assert main(["run", "-m", "/nonexistent.gguf"]) == 2
    assert "-p/--prompt or -f/--file is required" in capsys.readouterr().err
    assert main(["run", "-m", "/nonexistent.gguf", "-p", "x", "-sys", "brief"]) == 2
    assert "add -cnv" in capsys.readouterr().err


def test_every_command_owns_its_parser_and_main():
    for name, summary in COMMANDS.items():
        module = command_module(name)
        parser = module.build_parser()
        assert (parser.prog, parser.description) == (f"powerinfer {name}", summary)
        assert callable(module.main)


def test_help_lists_every_command_without_loading_one():
    """`powerinfer --help` names each command with its summary, importing no command (nor torch)."""
    import ast
    import subprocess
    import sys

    code = ("import sys\nfrom powerinfer.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
            "    print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('powerinfer.commands.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    help_text, loaded = result.stdout.rsplit("\n", 2)[:2]
    modules = {f"powerinfer.commands.{name.replace('-', '_')}" for name in COMMANDS} | {"torch"}
    assert not modules & set(ast.literal_eval(loaded)), loaded
    for name, summary in COMMANDS.items():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(summary)}$", help_text, re.MULTILINE), name


def test_the_server_imports_nothing_of_the_cli():
    """powerinfer/server/ is below the CLI: serve's command uses it, never the other way round."""
    import ast

    server = Path(__file__).parent.parent / "powerinfer" / "server"
    for path in server.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            assert not any(n == "powerinfer.cli" or n.startswith("powerinfer.commands") for n in names), path.name


def test_flag_defaults_are_the_apis():
    """The CLI's defaults are the Python API's: one definition (powerinfer/options.py) for both."""
    import inspect

    from powerinfer.commands.generation_flags import sampling_settings
    from powerinfer.llm import LLM
    from powerinfer.runtime.sampling import SamplingParams

    args = parse("run", "-p", "x")
    assert SamplingParams(**sampling_settings(args)) == SamplingParams()
    defaults = inspect.signature(LLM).parameters
    assert (args.dtype, args.sparsity, args.batch_size) == (defaults["dtype"].default, defaults["sparsity"].default,
                                                            defaults["n_batch"].default)


def test_serve_flag_defaults_are_the_servers():
    import inspect

    from powerinfer.server.app import create_app
    from powerinfer.server.connections import ConnectionLimits

    args = parse("serve")
    defaults = inspect.signature(create_app).parameters
    assert {name: defaults[name].default for name in ("max_body_size", "watchdog_seconds", "body_timeout",
                                                      "max_body_memory", "max_embedding_tokens")} == \
        dict(max_body_size=args.max_body_size, watchdog_seconds=args.watchdog, body_timeout=args.read_timeout,
             max_body_memory=args.max_body_memory, max_embedding_tokens=args.max_embedding_tokens)
    assert ConnectionLimits() == ConnectionLimits(args.read_timeout, args.keep_alive, args.max_connections)
