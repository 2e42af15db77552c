"""`powerinfer chat` in a real terminal (tmux): Ctrl-C, /commands, a context that fills up."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from powerinfer.commands.chat import Conversation, run_command

from helpers import CAPITAL_QUESTION

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/setup.sh installs it)")


class Terminal:
    """`powerinfer chat` in a detached pane of a tmux server of its own, read back with capture-pane."""

    def __init__(self, status_file: Path, *args: str):
        self.socket = f"powerinfer-test-{uuid.uuid4().hex[:8]}"
        self.status_file = status_file
        chat = shlex.join([sys.executable, "-m", "powerinfer.cli", "chat", *args])
        # A shell records the exit status (tmux's #{pane_dead_status} stays empty on some versions);
        # remain-on-exit keeps the pane, and so the screen, after the process ends.
        command = f"{chat}; echo $? > {shlex.quote(str(status_file))}"
        self.tmux("new-session", "-d", "-s", "chat", "-x", "160", "-y", "60", command,
                  ";", "set-option", "-t", "chat", "remain-on-exit", "on")

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen().splitlines() if line.strip()]

    def send(self, key: str) -> None:
        self.tmux("send-keys", "-t", "chat", key)

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-l", line)
        self.send("Enter")

    def wait_for(self, condition, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.1)
        raise AssertionError(f"waited {timeout:.0f} s for {what}; the screen:\n{self.screen()}")

    def wait_text(self, text: str) -> None:
        self.wait_for(lambda: text in self.screen(), repr(text))

    def at_prompt(self) -> bool:
        lines = self.lines()
        return bool(lines) and lines[-1] == ">"

    def wait_prompt(self) -> None:
        self.wait_for(self.at_prompt, "the prompt")

    def say(self, line: str) -> list[str]:
        """Send a line at the prompt; the lines printed until the next prompt."""
        self.wait_prompt()
        before = len(self.lines())
        self.type(line)
        self.wait_for(lambda: len(self.lines()) > before and self.at_prompt(), f"the answer to {line!r}")
        return self.lines()[before:-1]

    def dead(self) -> bool:
        return self.tmux("display-message", "-p", "-t", "chat", "#{pane_dead}").strip() == "1"

    def exit_status(self) -> int:
        self.wait_for(lambda: self.status_file.exists() and self.status_file.read_text().strip() != "",
                      "the chat to end", timeout=60)
        return int(self.status_file.read_text())

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def terminal(default_model, tmp_path):
    sessions: list[Terminal] = []

    def start(*args: str) -> Terminal:
        status_file = tmp_path / f"status-{len(sessions)}"
        sessions.append(Terminal(status_file, "-m", str(default_model), "--temp", "0", *args))
        return sessions[-1]

    yield start
    for session in sessions:
        session.close()


@needs_tmux
def test_ctrl_c_stops_the_reply_and_keeps_the_session(terminal):
    chat = terminal("-n", "2000")
    chat.wait_prompt()
    asked = len(chat.lines())
    chat.type("Count from 1 to 1000, separated by commas.")
    chat.wait_for(lambda: len(chat.lines()) > asked + 1, "the reply to start")  # the question, then reply text
    chat.send("C-c")
    chat.wait_text("[reply stopped]")
    reply = chat.say(CAPITAL_QUESTION)
    assert any("Paris" in line for line in reply), reply
    chat.send("C-c")  # at the prompt: the session ends, cleanly
    assert chat.exit_status() == 0
    assert "Traceback" not in chat.screen()


@needs_tmux
def test_slash_commands_never_reach_the_model(terminal):
    chat = terminal("-sys", "You are a helpful assistant.", "-n", "16")
    shown = chat.say("/help")
    assert [line.split()[0] for line in shown] == ["/help", "/clear", "/exit"], shown  # our list, no reply
    assert chat.say("Hello!")  # the model answers a message
    assert chat.say("/clear") == ["[conversation cleared (system prompt kept)]"]
    assert chat.say("/nonsense") == ["[unknown command /nonsense: /help lists the commands]"]
    chat.type("/exit")
    assert chat.exit_status() == 0


@needs_tmux
def test_a_full_context_drops_the_oldest_turns(terminal):
    chat = terminal("-c", "160", "-n", "-1", "-sys", "Answer in detail.")
    screens = [chat.say(question) for question in ("Describe Paris.", "Describe London.", "Describe Rome.")]
    screen = chat.screen()
    assert "[context full: dropped the" in screen, screen
    assert not chat.dead() and "error" not in screen.lower()
    assert all(screens)  # every question got an answer
    chat.send("C-d")
    assert chat.exit_status() == 0


def test_make_room_drops_whole_turns_oldest_first(default_llm):
    small = SimpleNamespace(chat_prompt=default_llm.chat_prompt, n_ctx=120)
    conversation = Conversation(small, "Be brief.")
    turns = []
    for i in range(6):
        turns += [{"role": "user", "content": f"Question number {i} about rivers?"},
                  {"role": "assistant", "content": f"Answer number {i}: the Nile, the Amazon and the Danube."}]
    everything = turns + [{"role": "user", "content": "And lakes?"}]
    conversation.turns = list(everything)
    assert conversation.make_room(reserve=30)
    kept = conversation.turns
    assert conversation.messages[0] == {"role": "system", "content": "Be brief."}
    assert kept[0]["role"] == "user" and kept == everything[-len(kept):]  # whole turns, the oldest first
    assert len(default_llm.chat_prompt(conversation.messages)) + 30 <= 120
    one_more = conversation.system + everything[-len(kept) - 2:]  # no more was dropped than needed
    assert len(kept) < len(everything) and len(default_llm.chat_prompt(one_more)) + 30 > 120


def test_clear_keeps_the_system_prompt():
    conversation = Conversation(SimpleNamespace(), "Be brief.")
    conversation.turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert run_command("/clear", conversation)
    assert conversation.messages == [{"role": "system", "content": "Be brief."}]
    assert not run_command("/exit", conversation) and not run_command("/quit", conversation)
