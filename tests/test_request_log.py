"""One log line per request: method, route, status, tokens in and out, milliseconds; text or JSON."""

from __future__ import annotations

import json
import logging

import httpx
import openai

from powerinfer.server.app import create_app

from helpers import ServerThread, serve_command, serving_url


def test_each_request_gets_one_line_with_its_tokens(default_llm, caplog):
    server = ServerThread(create_app(default_llm, parallel=2))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        with caplog.at_level(logging.INFO, logger="powerinfer.requests"):
            whole = client.completions.create(model="m", prompt="Once upon a time", max_tokens=5, temperature=0, n=2)
            chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=3, stream=True, temperature=0,
                                                         stream_options={"include_usage": True}))
            httpx.post(f"{server.url}/v1/completions", content=b"{bad", headers={"Content-Type": "application/json"})
    finally:
        server.stop()
    lines = [r.request for r in caplog.records if r.name == "powerinfer.requests"]
    assert [(line["method"], line["route"], line["status"]) for line in lines] == [
        ("POST", "/v1/completions", 200), ("POST", "/v1/chat/completions", 200), ("POST", "/v1/completions", 400)]
    assert (lines[0]["tokens_in"], lines[0]["tokens_out"]) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert (lines[1]["tokens_in"], lines[1]["tokens_out"]) == (chunks[-1].usage.prompt_tokens,
                                                               chunks[-1].usage.completion_tokens)
    assert (lines[2]["tokens_in"], lines[2]["tokens_out"]) == (0, 0)
    assert all(line["ms"] >= 0 for line in lines)


def test_log_format_json(default_model):
    process = serve_command("-m", str(default_model), "--port", "0", "-c", "128", "--log-format", "json")
    try:
        url = serving_url(process)
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    requests = [r for r in records if r["logger"] == "powerinfer.requests"]
    assert {(r["method"], r["route"], r["status"], r["tokens_out"]) for r in requests} >= {("POST", "/v1/completions", 200, 2)}
    assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's own lines are JSON too
    assert not [line for line in stderr.splitlines() if '"POST /v1/completions' in line]  # no second access line
