"""Hostile clients, files and faults (issue 22): empty API keys, abandoned requests, embeddings
beside generation, slow and idle connections, bodies and log lines proportional to the attack."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse
from starlette.testclient import TestClient

from powerinfer import LLM
from powerinfer.api.schemas import MAX_TOKEN_IDS
from powerinfer.commands.parsing import is_utf8
from powerinfer.commands.serve import MODEL_CHANGED_EXIT
from powerinfer.errors import ModelFileError
from powerinfer.gguf import open_gguf
from powerinfer.logs import MAX_LOGGED_CHARS
from powerinfer.runtime.constraint import GrammarError, json_schema_grammar
from powerinfer.runtime.scheduler import SlicedCall
from powerinfer.server import bodies, rendering
from powerinfer.server.app import create_app
from powerinfer.server.connections import ConnectionLimits
from powerinfer.tokenizer import Tokenizer

from conftest import convert_each, make_tiny_llama
from helpers import ServerThread, assert_one_line_error, powerinfer, serve_command, serving_url


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


# ---------------------------------------------------------------- a server over a tiny long-context model

N_CTX = 16384


@pytest.fixture(scope="module")
def long_llm(tmp_path_factory, default_model) -> LLM:
    """A tiny random ReLU llama with a 16k context (the default model's vocabulary): decode steps
    and 16k-token embeddings take seconds, not minutes."""
    folder = tmp_path_factory.mktemp("tiny-long")
    make_tiny_llama(folder, "relu", overrides={"max_position_embeddings": N_CTX})
    Tokenizer.from_gguf(open_gguf(default_model)).backend.save(str(folder / "tokenizer.json"))
    return LLM(convert_each(folder, ("q8_0",))["q8_0"], n_ctx=N_CTX)


class Serving(ServerThread):
    """A ServerThread under our connection limits, with the scheduler's state and a context manager."""

    def __init__(self, app, limits: ConnectionLimits | None = None):
        super().__init__(app, limits or ConnectionLimits())

    @property
    def scheduler(self):
        return self.server.config.app.state.server.scheduler

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (stats := self.scheduler.stats()).active or stats.queued or stats.sliced:
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {stats}"
            time.sleep(0.01)

    def __enter__(self) -> Serving:
        return self

    def __exit__(self, *_) -> None:
        self.stop()


def never_ending(llm: LLM) -> dict:
    """Sampling fields that keep a random model generating: its end-of-generation tokens banned."""
    return {"temperature": 0, "logit_bias": {str(i): -100 for i in llm.tokenizer.eog_ids}}


def test_abandoned_requests_free_their_slots(long_llm):
    """Eight non-streaming clients asking for 4000 tokens leave after 1 s (curl -m 1); a
    legitimate request then completes within 5 s (it used to wait minutes behind them)."""
    with Serving(create_app(long_llm, parallel=4)) as serving:
        hostile = [("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4000, **never_ending(long_llm)}),
                   ("/completion", {"prompt": "Once upon a time", "n_predict": 4000, **never_ending(long_llm)})] * 4

        def abandon(route: str, body: dict) -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(serving.url + route, json=body, timeout=httpx.Timeout(60, read=1))

        with ThreadPoolExecutor(len(hostile)) as pool:
            list(pool.map(lambda case: abandon(*case), hostile))
        left = time.monotonic()
        answer = httpx.post(f"{serving.url}/v1/completions", timeout=60,
                            json={"prompt": "Hello", "max_tokens": 8, **never_ending(long_llm)})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        assert time.monotonic() - left < 5
        serving.wait_idle(5)
        assert serving.scheduler.stats().generated_tokens < 8 * 4000 // 4


def stream_gaps(url: str, llm: LLM, n: int = 40) -> list[float]:
    """Seconds between the token events of one streamed completion of `n` tokens."""
    arrivals = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"prompt": "The river", "max_tokens": n, "stream": True, **never_ending(llm)}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    assert len(arrivals) >= n - 1
    return [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # from the second token: the first waits for a prefill


def embedding_input(n_inputs: int, length: int) -> list[list[int]]:
    return [[(7919 * (i + 1) * (j + 1)) % 49152 for j in range(length)] for i in range(n_inputs)]


def test_embeddings_run_beside_generation(long_llm):
    """A 16k-token embedding request (4 inputs of 4096 tokens) in slices between decode steps:
    a completion's inter-token latency stays within 3x its solo value while it runs."""
    inputs = embedding_input(4, 4096)
    with Serving(create_app(long_llm, parallel=2)) as serving, ThreadPoolExecutor(1) as pool:
        solo = statistics.mean(stream_gaps(serving.url, long_llm))
        embedding = pool.submit(httpx.post, f"{serving.url}/v1/embeddings", json={"input": inputs}, timeout=300)
        deadline = time.monotonic() + 30
        while serving.scheduler.stats().sliced == 0:
            assert time.monotonic() < deadline and not embedding.done(), "the embedding never started"
            time.sleep(0.005)
        beside = statistics.mean(stream_gaps(serving.url, long_llm))
        still_embedding = serving.scheduler.stats().sliced == 1
        answer = embedding.result()
    # the mean, not the median: an embedding run in one piece shows as one long gap
    assert beside <= 3 * solo, f"inter-token latency {beside * 1e3:.1f} ms beside the embedding, {solo * 1e3:.1f} ms solo"
    assert still_embedding, "the embedding ended before the stream: the stream was not measured beside it"
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 4 * 4096
    vectors = [item["embedding"] for item in answer.json()["data"]]
    assert np.allclose(vectors, long_llm.embed(inputs), atol=1e-4)  # slicing changes nothing but rounding


def test_embedding_is_cancelled_when_its_client_leaves(long_llm, monkeypatch):
    """The embedding's first slice is held until the server cancels the call (its client left
    after 1 s): a fast machine cannot finish it first. It then stops without running to its end."""
    cancelled, finished = threading.Event(), []
    cancel, embedding_steps = SlicedCall.cancel, long_llm.embedding_steps

    def cancel_and_tell(call: SlicedCall) -> None:
        cancel(call)
        cancelled.set()

    def held_embedding_steps(token_lists):
        steps = embedding_steps(token_lists)
        budget = yield next(steps)
        cancelled.wait(30)
        while True:
            try:
                budget = yield steps.send(budget)
            except StopIteration as end:
                finished.append(True)
                return end.value

    monkeypatch.setattr(SlicedCall, "cancel", cancel_and_tell)
    monkeypatch.setattr(long_llm, "embedding_steps", held_embedding_steps)
    with Serving(create_app(long_llm, parallel=1)) as serving:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{serving.url}/v1/embeddings", json={"input": embedding_input(4, 4096)},
                       timeout=httpx.Timeout(60, read=1))
        assert cancelled.wait(10), "the server never cancelled the embedding"
        serving.wait_idle(10)
    assert not finished, "the embedding ran to its end after its client left"


def test_embedding_token_budget(long_llm):
    with Serving(create_app(long_llm, max_embedding_tokens=1000)) as serving:
        over = httpx.post(f"{serving.url}/v1/embeddings", json={"input": embedding_input(2, 501)})
        assert over.status_code == 400 and over.json()["error"]["param"] == "input"
        assert "1002 tokens" in over.json()["error"]["message"]
        assert httpx.post(f"{serving.url}/v1/embeddings", json={"input": embedding_input(2, 500)}).status_code == 200


# ---------------------------------------------------------------- connections

QUICK = ConnectionLimits(read_timeout=1.0, keep_alive=1.0, max_connections=4)


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and how long that took. A server
    closing with part of our data unread resets the connection: what came before may be lost."""
    sock.settimeout(timeout)
    started, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - started


@pytest.fixture(scope="module")
def quick(long_llm):
    with Serving(create_app(long_llm, body_timeout=1.0, max_body_memory=1024 * 1024), QUICK) as serving:
        yield serving


def test_headers_sent_slowly_get_408_and_are_closed(quick):
    with socket.create_connection(quick.address) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()
        for _ in range(10):  # a header line every 0.2 s: the connection stays busy, never complete
            try:
                sock.sendall(b"X-Slow: yes\r\n")
            except OSError:
                break
            time.sleep(0.2)
        data, _ = read_until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - started < 4


def test_a_connection_that_sends_nothing_is_closed(quick):
    with socket.create_connection(quick.address) as sock:
        data, waited = read_until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 408") and waited < 4


def test_idle_keep_alive_connection_is_closed(quick):
    with socket.create_connection(quick.address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data, waited = read_until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 200") and waited < 4


def test_body_sent_slowly_gets_408_and_the_connection_closes(quick):
    with socket.create_connection(quick.address) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"content\": \"")
        started = time.monotonic()
        for _ in range(15):  # a byte every 0.2 s: never the whole body
            try:
                sock.sendall(b"a")
            except OSError:
                break
            time.sleep(0.2)
        data, _ = read_until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 408") and b"--read-timeout" in data
    assert time.monotonic() - started < 5


def test_connections_beyond_the_limit_get_503(quick):
    idle = [socket.create_connection(quick.address) for _ in range(QUICK.max_connections)]
    try:
        time.sleep(0.2)  # the server has accepted them
        assert httpx.get(f"{quick.url}/health").status_code == 503
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{quick.url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_memory_of_bodies_being_read_is_bounded(quick, caplog):
    """Two clients each sending 600 KB of a 1 MB body: the second passes the server's 1 MiB for
    bodies being read and is refused (503, and its connection closed); the first is still being
    read; once they are gone, bodies are read again."""
    head = (b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n")
    first, second = socket.create_connection(quick.address), socket.create_connection(quick.address)
    try:
        first.sendall(head + b"x" * 600_000)
        time.sleep(0.3)
        second.sendall(head + b"x" * 600_000)
        data, waited = read_until_closed(second, 10)
        assert waited < 5 and (data == b"" or data.startswith(b"HTTP/1.1 503"))  # a reset may come before the 503
        refusals = [r.getMessage() for r in caplog.records if "refused a request body" in r.getMessage()]
        assert len(refusals) == 1 and "503" in refusals[0] and "--max-body-memory" in refusals[0]
    finally:
        first.close()
        second.close()
    assert httpx.post(f"{quick.url}/tokenize", json={"content": "hello"}).status_code == 200


def memory_of(pid: int) -> dict[str, int]:
    """A process's memory figures from /proc (VmData: heap, anonymous memory, thread stacks), in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmData", "VmRSS", "VmHWM")}


def slowloris(address: tuple[str, int], seconds: float) -> bytes:
    """Headers a line every 0.25 s, never finished; what the server sent before closing."""
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        deadline = time.monotonic() + seconds
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline:
                sock.sendall(b"X-Slow: yes\r\n")
                time.sleep(0.25)
        return read_until_closed(sock, 10)[0]


def half_sent_body(address: tuple[str, int], sent: int) -> bytes:
    """An 8 MB body of which `sent` bytes come, then nothing; what the server sent before closing."""
    with socket.create_connection(address) as sock:
        with contextlib.suppress(OSError):  # the server may close while we send
            sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 8000000\r\n\r\n" + b"x" * sent)
        return read_until_closed(sock, 20)[0]


def test_connection_attacks_on_a_server_whose_memory_is_capped(long_llm):
    """`serve` in a child whose data segment is capped (RLIMIT_DATA, set once it is idle) at 256 MiB
    over what it holds then, against 60 slowloris connections and 60 half-sent bodies of 6 MB each
    (360 MB in all). Each attacker is closed with 408 or 503; the server keeps answering /health and
    completions meanwhile, and its peak resident memory grows by less than the cap's headroom (with
    --max-body-memory 2 GB it grew by more: 266 MB, measured here)."""
    headroom, n_each, sent = 256 * 1024 * 1024, 60, 6_000_000
    assert n_each * sent > headroom
    process = serve_command("-m", str(long_llm.path), "--port", "0", "-c", "256", "--parallel", "1",
                            "--read-timeout", "3")
    try:
        url = serving_url(process)
        threading.Thread(target=process.stderr.read, daemon=True).start()  # its log must not fill the pipe
        complete(url)  # the first completion's one-off allocations, before the cap
        idle = memory_of(process.pid)
        resource.prlimit(process.pid, resource.RLIMIT_DATA, (idle["VmData"] + headroom,) * 2)
        address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        with ThreadPoolExecutor(2 * n_each) as pool:
            slow = [pool.submit(slowloris, address, 6) for _ in range(n_each)]
            bodies_sent = [pool.submit(half_sent_body, address, sent) for _ in range(n_each)]
            answered = 0
            while not all(f.done() for f in slow + bodies_sent):
                assert httpx.get(f"{url}/health", timeout=30).status_code == 200
                assert complete(url)
                answered += 1
            answers = [f.result() for f in slow + bodies_sent]
        after = memory_of(process.pid)
        assert all(a == b"" or a.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")) for a in answers), \
            {a[:40] for a in answers}
        assert sum(a.startswith(b"HTTP/1.1 408") for a in answers[:n_each]) >= n_each // 2
        assert answered >= 1 and process.poll() is None
        assert after["VmHWM"] - idle["VmHWM"] < headroom
        assert httpx.get(f"{url}/health").status_code == 200 and complete(url)
    finally:
        process.terminate()
        process.wait(timeout=60)


# ---------------------------------------------------------------- bodies: work and log lines bounded

def json_values(value) -> int:
    """Values in a parsed JSON value as the body budget counts them: the root, each array item,
    each object key and value."""
    if isinstance(value, list):
        return 1 + sum(json_values(item) for item in value)
    if isinstance(value, dict):
        return 1 + sum(1 + json_values(item) for item in value.values())
    return 1


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(),
                           lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
                           max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUES, indent=st.sampled_from([None, 0, 2]), spaced=st.booleans(), budget=st.integers(1, 60))
def test_values_are_counted_before_parsing_as_the_parsed_body_counts_them(value, indent, spaced, budget):
    """The scan over the body's bytes (strings with escaped quotes, commas and brackets inside,
    empty arrays with spaces) agrees with the count over what the json module parses."""
    raw = json.dumps(value, indent=indent, ensure_ascii=False).encode()
    if spaced:  # (inside strings too: their text changes, not the count)
        raw = raw.replace(b"[]", b"[  ]").replace(b"{}", b"{ }")
    assert bodies.within_budget(raw, budget) == (json_values(json.loads(raw)) <= budget)


def test_a_body_being_parsed_holds_no_other_client(long_llm, monkeypatch):
    """The parse of a body is held (in the test) until another client has been answered: were it
    on the event loop, that client would wait for it, and the test would time out."""
    parsing, answered, decoded = threading.Event(), threading.Event(), bodies.decoded

    def held_decoded(raw: bytes):
        parsing.set()
        answered.wait(30)
        return decoded(raw)

    monkeypatch.setattr(bodies, "decoded", held_decoded)
    with Serving(create_app(long_llm)) as serving, ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{serving.url}/tokenize", json={"content": "hello"}, timeout=60)
        assert parsing.wait(30), "the body never reached its parser"
        assert httpx.get(f"{serving.url}/health", timeout=10).status_code == 200
        assert not held.done()
        answered.set()
        assert held.result().json()["tokens"] == long_llm.tokenize("hello", add_bos=False, special=True)


def test_a_flood_of_large_bodies_leaves_other_clients_answered(long_llm):
    """Eight clients send two 8 MB bodies each, of 2.7 million values (refused by the values budget:
    parsed whole, each holds the interpreter for about half a second in one call). Meanwhile another
    client's /health and small /tokenize are answered, each within a fifth of the flood's time
    (its values are counted first, in short steps). Sixteen bodies, not eight: a wait (two requests)
    can meet a parse that takes the interpreter first for each, which came to a fifth of eight bodies'
    flood on a fast CPU (AVX-512 EPYC: 0.58-0.72 s of 2.5-2.6 s)."""
    flood = b'{"content": "x", "padding": [' + b"{}," * 2_700_000 + b"{}]}"
    assert len(flood) < 8 * 1024 * 1024
    with Serving(create_app(long_llm)) as serving, ThreadPoolExecutor(8) as pool:
        started = time.monotonic()
        posts = [pool.submit(httpx.post, f"{serving.url}/tokenize", content=flood, timeout=300,
                             headers={"Content-Type": "application/json"}) for _ in range(16)]
        waits = []
        while not all(post.done() for post in posts):
            asked = time.monotonic()
            assert httpx.get(f"{serving.url}/health", timeout=60).status_code == 200
            assert httpx.post(f"{serving.url}/tokenize", json={"content": "hi"}, timeout=60).status_code == 200
            waits.append(time.monotonic() - asked)
        flood_seconds = time.monotonic() - started
        answers = [post.result() for post in posts]
    assert all(a.status_code == 400 and "524288 JSON values" in a.json()["error"]["message"] for a in answers)
    # the median: one wait may meet a scheduler hiccup of a shared machine; parsing on the loop made
    # every wait a parse or more (0.61 of the flood)
    assert len(waits) >= 5 and statistics.median(waits) < flood_seconds / 5 and max(waits) < flood_seconds / 2, \
        f"clients waited {statistics.median(waits):.2f} s (median), up to {max(waits):.2f} s, of the flood's " \
        f"{flood_seconds:.1f} s ({len(waits)} asked)"


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES | st.dictionaries(st.text(max_size=3), st.lists(st.integers(-2**63, 2**63) | st.floats(allow_nan=False,
       allow_infinity=False), max_size=9000), max_size=3) | st.dictionaries(st.integers(), st.integers(), max_size=3))
def test_answers_render_as_starlette_renders_them(value):
    """Rendered a slice at a time (lists of thousands of values), byte for byte JSONResponse's rendering."""
    assert rendering.rendered(value) == JSONResponse(value).body


def test_an_answer_of_600000_ids_leaves_other_clients_answered(long_llm):
    """/tokenize of 3.6 MB of text answers 600000 ids (FastAPI's encoding of them took 2.6 s on
    the event loop); meanwhile another client's /health is answered, each within a tenth of the time."""
    text = "hello world " * 300_000
    with Serving(create_app(long_llm)) as serving, ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        big = pool.submit(httpx.post, f"{serving.url}/tokenize", json={"content": text}, timeout=300)
        waits = []
        while not big.done():
            asked = time.monotonic()
            assert httpx.get(f"{serving.url}/health", timeout=60).status_code == 200
            waits.append(time.monotonic() - asked)
            time.sleep(0.01)
        seconds = time.monotonic() - started
        tokens = big.result().json()["tokens"]
    assert tokens == long_llm.tokenize(text, add_bos=False, special=True) and len(tokens) >= 600_000
    assert len(waits) >= 5 and max(waits) < seconds / 10, f"/health waited up to {max(waits):.2f} s of {seconds:.1f} s"


@pytest.fixture(scope="module")
def client(long_llm):
    with TestClient(create_app(long_llm, parallel=2)) as test_client:
        yield test_client


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_schema_nested_too_deep_for_the_grammar_library_is_refused(client):
    with pytest.raises(GrammarError, match="unusable JSON schema"):
        json_schema_grammar(nested_schema(64))
    for levels in (30, 64):  # within the body's nesting limit (then the grammar's), and beyond it
        answer = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format": {
                "type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(levels)}}})
        assert answer.status_code in (200, 400), answer.text
    assert answer.status_code == 400 and "nested more than 64 levels" in answer.json()["error"]["message"]


def test_tool_call_arguments_nested_5000_deep(client):
    deep = "[" * 5000 + "]" * 5000
    answer = client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]})
    assert answer.status_code == 200, answer.text


def test_a_body_nested_5000_deep_gets_400(client):
    answer = client.post("/v1/completions", content=b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                         headers={"Content-Type": "application/json"})
    assert answer.status_code == 400


def test_millions_of_ids_are_refused_before_their_validation(client):
    answer = client.post("/detokenize", content=b'{"tokens": [' + b"1," * 3_999_999 + b"1]}",
                         headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "524288 JSON values" in answer.json()["error"]["message"]
    answer = client.post("/detokenize", json={"tokens": [1] * (MAX_TOKEN_IDS + 1)})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tokens"
    ids = list(range(MAX_TOKEN_IDS // 64))
    # special tokens rendered, as llama-server's /detokenize does
    expected = client.app.state.server.llm.detokenize(ids, special=True)
    assert client.post("/detokenize", json={"tokens": ids}).json()["content"] == expected


def test_log_lines_are_capped(client, caplog):
    body = {"prompt": "hi", "max_tokens": 1, **{f"unknown_field_{i}": i for i in range(100_000)}}
    assert client.post("/v1/completions", json=body).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "nobody defines" in r.getMessage()]
    assert warnings and "100000 fields" in warnings[0]
    assert max(len(r.getMessage()) for r in caplog.records) <= 2 * MAX_LOGGED_CHARS


# ---------------------------------------------------------------- a model file changed while served

def serve_file(model: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "powerinfer.cli", "serve", "-m", str(model), "--port", "0",
                                "-c", "256", "--parallel", "1"], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = re.search(r"listening on (http://\S+)", process.stderr.readline()).group(1)
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return process, url


def complete(url: str) -> str:
    answer = httpx.post(f"{url}/completion", json={"prompt": "Hello", "n_predict": 8, "temperature": 0}, timeout=60)
    return answer.json()["content"]


def test_model_file_replaced_or_rewritten_while_served(long_llm, tmp_path):
    """Replaced by a rename (mv, our own writers): the server keeps the file it mapped and answers
    as before. Rewritten in place (truncated, as cp starts by doing): the next read of a lost page
    kills it with one line and exit status 74, never silently."""
    served = tmp_path / "model.gguf"
    shutil.copy(long_llm.path, served)
    process, url = serve_file(served)
    try:
        before = complete(url)
        other = tmp_path / "other.gguf"
        other.write_bytes(b"GGUF" + bytes(1000))
        os.replace(other, served)
        assert complete(url) == before
    finally:
        process.terminate()
        process.wait(timeout=30)
    shutil.copy(long_llm.path, served)
    process, url = serve_file(served)
    try:
        os.truncate(served, 4096)
        with pytest.raises(httpx.TransportError):
            complete(url)
        assert process.wait(timeout=30) == MODEL_CHANGED_EXIT
        last_line = process.stderr.read().strip().splitlines()[-1]
        assert str(served) in last_line and "changed while served" in last_line and "rename" in last_line
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# ---------------------------------------------------------------- files that would fail later: one line at load

def test_predictor_shapes_that_disagree_are_refused_at_load(tmp_path):
    from gguf import GGMLQuantizationType as T

    from powerinfer.gguf.writer import TensorData, write_gguf
    from powerinfer.sparse.predictor import load_predictor

    def predictor_file(fc1: tuple[int, int], fc2: tuple[int, int]) -> Path:
        path = tmp_path / f"p{fc1}{fc2}.gguf"
        write_gguf(path, "llama", {}, [TensorData(f"blk.0.{name}.weight", np.ones(shape, np.float32), T.F32)
                                       for name, shape in (("fc1", fc1), ("fc2", fc2))])
        return path

    assert load_predictor(open_gguf(predictor_file((8, 96), (128, 8))), 0, shape=(96, 128)).nbytes > 0
    with pytest.raises(ModelFileError, match=r"shapes \[8, 96\] and \[128, 4\]"):
        load_predictor(open_gguf(predictor_file((8, 96), (128, 4))), 0)  # fc2 does not take fc1's rank
    with pytest.raises(ModelFileError, match=r"needs \[R, 64\] and \[128, R\]"):
        load_predictor(open_gguf(predictor_file((8, 96), (128, 8))), 0, shape=(64, 128))


VOCABULARIES = {
    "repeated": (["a", "b", "ab", "a"], ["a b"], "token 3 repeats token 0"),
    "empty": (["a", "", "b", "ab"], ["a b"], "token 1 is empty"),
    "merge without a space": (["a", "b", "ab"], ["ab"], "merge 0 ('ab') is not two tokens"),
    "merge of unknown pieces": (["a", "b", "ab"], ["x y"], "merge 0 ('x y') is not two tokens"),
    "merge of three pieces": (["a", "b", "ab", "c"], ["a b c"], "merge 0 ('a b c') is not two tokens"),
}


@pytest.mark.parametrize("case", VOCABULARIES)
def test_broken_vocabularies_are_one_error(tmp_path, case):
    from powerinfer.gguf.writer import write_gguf

    tokens, merges, message = VOCABULARIES[case]
    path = tmp_path / "vocab.gguf"
    write_gguf(path, "llama", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
                               "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges}, [])
    with pytest.raises(ModelFileError, match=re.escape(message)):
        Tokenizer.from_gguf(open_gguf(path))


@pytest.mark.parametrize("flags", [["-c", str(2**40)], ["--parallel", str(10**9)]])
def test_a_kv_cache_that_cannot_be_held_is_refused_with_its_size(long_llm, flags):
    assert_one_line_error(powerinfer("serve", "-m", str(long_llm.path), "--port", "0", *flags), "GiB", "lower -c or --parallel")


def test_run_with_a_context_too_large_is_refused_with_its_size(long_llm):
    assert_one_line_error(powerinfer("run", "-m", str(long_llm.path), "-p", "hi", "-n", "1", "-c", str(2**40)),
                          "a KV cache of 1 slot(s) x 1099511627776 tokens needs")


# ---------------------------------------------------------------- every flag's value space

HOSTILE_VALUES = ["0", "1", "-1", "-0", "2", "65535", "65536", str(2**31), str(2**63), str(2**64), str(2**64 + 1),
                  str(10**30), "-" + str(2**64), "1e308", "1e309", "inf", "-inf", "nan", "NaN", "0x10", "1_000",
                  " 1", "", " ", "\udcff", "caf\udce9", "\x00", "1.5", "-1.5", "1e-320",
                  "0\r", "0\n", "-1\u2028", "-5\x85"]
REQUIRED_ARGS = {"perplexity": ["-f", "t.txt"], "profile": ["-f", "t.txt", "-o", "out"],
                 "train-predictors": ["-f", "t.txt", "-o", "out"], "place": ["--vram-budget", "1"],
                 "convert": ["model"], "quantize": ["in.gguf", "out.gguf", "q4_0"], "inspect": ["x"]}


@functools.cache
def command_parsers() -> dict:
    from powerinfer.commands import COMMANDS, command_module

    return {name: command_module(name).build_parser() for name in COMMANDS}


def typed_flags() -> list[tuple[str, str]]:
    """(command, flag) for every flag of every command that parses its value."""
    return sorted({(name, action.option_strings[-1]) for name, sub in command_parsers().items()
                   for action in sub._actions if action.option_strings and action.type is not None and action.nargs != 0})


def parse_one(command: str, flag: str, value: str) -> tuple[int, str, object]:
    """(exit status, stderr, parsed value) of `powerinfer COMMAND ... FLAG VALUE` at the command's parser."""
    parser = command_parsers()[command]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args([*REQUIRED_ARGS.get(command, []), flag, value])
    except SystemExit as stop:
        return stop.code, stderr.getvalue(), None
    return 0, stderr.getvalue(), getattr(args, parser._option_string_actions[flag].dest)


@pytest.mark.parametrize("command, flag", typed_flags())
@settings(max_examples=60, deadline=None)
@given(value=st.sampled_from(HOSTILE_VALUES) | st.text(max_size=12) | st.integers().map(str)
       | st.floats().map(repr))
@example(value="0\r")  # int() strips the line break that the error message echoes
@example(value="-1\u2028")
def test_every_flag_value_parses_or_is_one_line(command, flag, value):
    """Any value of any flag: a sane parsed value, or one line and exit 2 (nothing reaches a command
    that it would fail on with a traceback: NaN, infinities, integers beyond 64 bits, odd ports)."""
    status, stderr, parsed = parse_one(command, flag, value)
    if status != 0:
        assert status == 2 and len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
        return
    for item in parsed if isinstance(parsed, list) else [parsed]:
        if isinstance(item, float):
            assert math.isfinite(item), (flag, value, item)
        if isinstance(item, int):
            assert -(2**63) <= item < 2**63, (flag, value, item)
        if isinstance(item, str):
            assert is_utf8(item), (flag, value)
    if flag == "--port":
        assert 0 <= parsed <= 65535


def test_text_that_is_not_utf8_is_one_line(long_llm):
    """Bytes that are not UTF-8 in -p (argv) and in chat's input (stdin); -f has its own check."""
    result = subprocess.run([sys.executable, "-m", "powerinfer.cli", "run", "-m", str(long_llm.path), "-p", b"caf\xe9",
                             "-n", "1"], capture_output=True, text=True, timeout=300)
    assert_one_line_error(result, "-p/--prompt: is not valid UTF-8 text")
    result = subprocess.run([sys.executable, "-m", "powerinfer.cli", "chat", "-m", str(long_llm.path), "-n", "1"],
                            input=b"caf\xe9\n", capture_output=True, timeout=300)
    # the model has no chat template: a note says which built-in one is used, then the one error line
    lines = [line for line in result.stderr.decode().splitlines() if "built-in" not in line]
    assert result.returncode == 2 and lines == ["powerinfer chat: error: the input is not valid UTF-8 text"]
