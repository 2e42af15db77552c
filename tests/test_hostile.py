"""Hostile clients, files and faults (issue 22): empty API keys, abandoned requests, embeddings
beside generation, slow and idle connections, bodies and log lines proportional to the attack."""

from __future__ import annotations

import pytest

from helpers import assert_one_line_error, powerinfer


@pytest.mark.parametrize("keys", [["--api-key", ""], ["--api-key", "good", "--api-key", "  "]])
def test_empty_api_key_is_refused_at_start_up(tmp_path, keys):
    result = powerinfer("serve", "-m", str(tmp_path / "never-read.gguf"), "--port", "0", *keys)
    assert_one_line_error(result, "--api-key is empty")


@pytest.mark.parametrize("text", ["\n", "key\n   \nother\n"])
def test_key_file_with_an_empty_line_is_refused_at_start_up(tmp_path, text):
    keys = tmp_path / "keys.txt"
    keys.write_text(text)
    result = powerinfer("serve", "-m", str(tmp_path / "never-read.gguf"), "--port", "0", "--api-key-file", str(keys))
    assert_one_line_error(result, f"{keys}: line", "is empty")
