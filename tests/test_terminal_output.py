"""What a terminal shows: perplexity's values stay visible when stdout and stderr share one."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

WIKITEXT = Path(__file__).parent / "data" / "wikitext-2" / "valid.txt"


def on_a_terminal(*args: str, timeout: float = 300) -> str:
    """The CLI's stdout and stderr as one terminal shows them (both on one pseudo-terminal)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "powerinfer.cli", *args], stdin=subprocess.DEVNULL,
                               stdout=follower, stderr=follower, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(follower)
    output = b""
    while True:
        ready, _, _ = select.select([leader], [], [], timeout)
        assert ready, "no output"
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert process.wait(timeout=timeout) == 0, output.decode(errors="replace")
    return output.decode()


def test_perplexity_values_are_not_overwritten(default_model):
    screen = on_a_terminal("perplexity", "-m", str(default_model), "-f", str(WIKITEXT), "-c", "64", "--chunks", "3")
    assert "\r" not in screen.replace("\r\n", "\n"), screen  # nothing redraws a line
    assert re.search(r"\[1\]\d+\.\d{4},\[2\]\d+\.\d{4},\[3\]\d+\.\d{4},", screen), screen
    assert re.search(r"perplexity: \d+\.\d\d seconds per chunk - ETA \d+\.\d\d minutes", screen), screen
    assert "Final estimate: PPL = " in screen
