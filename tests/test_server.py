"""The HTTP server: OpenAI and llama.cpp routes, continuous batching, robustness against any body."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerinfer.api import schemas
from powerinfer.errors import PowerInferError
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.scheduler import Event, Request, Scheduler
from powerinfer.server.app import create_app
from powerinfer.server.gate import LOOPBACK_HOSTS
from powerinfer.server.generation import Mailbox

from helpers import CAPITAL_QUESTION, PARALLEL, ServerThread, assert_error, serve_command, serving_url

JSON_HEADERS = {"Content-Type": "application/json"}
PROMPTS = [f"{subject} is" for subject in (
    "The capital of France", "Water", "A good breakfast", "The tallest mountain", "Python", "The moon",
    "My favourite colour", "The first computer", "A triangle", "Winter", "The ocean", "Music",
    "The best way to learn", "A cat", "The year 1492", "Coffee")]


def scheduler_of(server: ServerThread):
    return server.server.config.app.state.server.scheduler


def wait_idle(server: ServerThread, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while scheduler_of(server).stats().active or scheduler_of(server).stats().queued:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.01)


# ---------------------------------------------------------------- routes


def test_health_models_tokenize_detokenize(server, default_llm, model_id):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert model_id == default_llm.path.name
    ids = httpx.post(f"{server.url}/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert ids == default_llm.tokenize("Hello world", add_bos=False)
    special = httpx.post(f"{server.url}/tokenize", json={"content": "Hi", "add_special": True}).json()["tokens"]
    assert special == default_llm.tokenize("Hi", add_bos=True)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {"content": "Hello world"}


def test_completion_greedy_equals_generate(client, model_id, default_llm):
    prompt = "The capital of France is"
    expected = default_llm.complete(prompt, max_tokens=12, temperature=0)
    answer = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0)
    assert answer.choices[0].text == expected.text
    assert answer.choices[0].finish_reason == expected.finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (expected.prompt_tokens, 12)
    assert answer.usage.total_tokens == expected.prompt_tokens + 12
    pieces = list(client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == expected.text
    assert pieces[-1].choices[0].finish_reason == "length"
    ids = default_llm.tokenize(prompt)
    assert client.completions.create(model=model_id, prompt=ids, max_tokens=12, temperature=0).choices[0].text == expected.text


def test_seeded_sampling_equals_generate(client, model_id, default_llm):
    sampling = dict(temperature=1.0, top_p=0.9, seed=1234)
    expected = default_llm.generate("Once upon a time", max_tokens=16, top_k=40, min_p=0.05, **sampling)
    answer = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=16, **sampling)
    assert answer.choices[0].text == expected


def test_stop_string(client, model_id, default_llm):
    full = default_llm.generate("1, 2, 3, 4,", max_tokens=16, temperature=0)
    stop = full.strip()[2:5]
    answer = client.completions.create(model=model_id, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[stop])
    assert answer.choices[0].finish_reason == "stop"
    assert full.startswith(answer.choices[0].text) and stop not in answer.choices[0].text


def test_chat_greedy_equals_llm_chat(client, model_id, default_llm):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name three rivers."}]
    expected = default_llm.chat(messages, max_tokens=24, temperature=0)
    answer = client.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0)
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(default_llm.chat_prompt(messages))
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens


def test_chat_stops_at_end_of_turn(client, model_id, default_llm):
    messages = [{"role": "user", "content": CAPITAL_QUESTION}]
    answer = client.chat.completions.create(model=model_id, messages=messages, max_tokens=64, temperature=0)
    assert answer.choices[0].finish_reason == "stop" and "Paris" in answer.choices[0].message.content
    assert answer.choices[0].message.content == default_llm.chat(messages, max_tokens=64, temperature=0)


def test_llama_completion(server, default_llm):
    prompt = "The capital of France is"
    expected = default_llm.generate(prompt, max_tokens=8, temperature=0)
    body = httpx.post(f"{server.url}/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0}, timeout=60).json()
    assert body["content"] == expected and body["stop"] is True and body["stop_type"] == "limit"
    assert body["tokens_predicted"] == 8 and body["tokens_evaluated"] == len(default_llm.tokenize(prompt))
    assert body["timings"]["predicted_n"] == 8 and body["timings"]["predicted_per_second"] > 0
    with httpx.stream("POST", f"{server.url}/completion", timeout=60,
                      json={"prompt": prompt, "n_predict": 8, "temperature": 0, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == expected
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["tokens_predicted"] == 8


def test_metrics(server, client, model_id):
    before = httpx.get(f"{server.url}/metrics").text
    client.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0)
    after = httpx.get(f"{server.url}/metrics").text
    value = lambda text, name: float(re.search(rf"^powerinfer_{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    assert value(after, "requests_total") == value(before, "requests_total") + 1
    assert value(after, "tokens_generated_total") == value(before, "tokens_generated_total") + 4
    assert value(after, "prompt_tokens_total") > value(before, "prompt_tokens_total")
    assert value(after, "tokens_per_second") > 0
    assert value(after, "queue_length") == 0 and value(after, "active_slots") == 0 and value(after, "slots") == PARALLEL


# ---------------------------------------------------------------- OpenAI features


def test_n_choices_share_one_prefill(server, client, model_id, default_llm):
    """n=3 seeded choices: choice i is what a single request with seed + i gives (its slot got a
    copy of the prefilled cache), and the prompt is evaluated once."""
    prompt, seed = "Once upon a time", 77
    singles = [default_llm.generate(prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=seed + i) for i in range(3)]
    before = scheduler_of(server).stats().prompt_tokens
    answer = client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=1.0, top_p=0.9,
                                       seed=seed, n=3)
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == singles
    assert scheduler_of(server).stats().prompt_tokens - before == len(default_llm.tokenize(prompt))
    assert answer.usage.completion_tokens == 30
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=1.0, top_p=0.9,
                                           seed=seed, n=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == singles
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=6, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


# LLM.logits evaluates all positions in one batch, generation one token per step. The quantized
# kernels round activations to bfloat16 per batch shape (the two differ by up to ~0.05 there), so
# the comparison runs on the float32 model, whose arithmetic agrees across paths to rounding.
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def float32_llm(default_model):
    from powerinfer import LLM

    return LLM(default_model, n_ctx=512, dtype="float32")


def _log_softmax(default_llm, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(torch.from_numpy(default_llm.logits(ids)), dim=-1)


def test_logprobs_are_log_softmax_of_the_logits(float32_llm):
    """Greedy: each token's logprob and its top alternatives equal log_softmax of LLM.logits at
    that position (both shapes: completions and chat)."""
    running = ServerThread(create_app(float32_llm, parallel=1))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0, timeout=60)
        _check_logprobs(client, client.models.list().data[0].id, float32_llm)
    finally:
        running.stop()


def _check_logprobs(client, model_id, default_llm):
    prompt = "The capital of France is"
    answer = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    expected = default_llm.complete(prompt, max_tokens=6, temperature=0)
    ids = default_llm.tokenize(prompt)
    reference = _log_softmax(default_llm, ids + expected.tokens)[len(ids) - 1 : -1]
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == [default_llm.detokenize([t]) for t in expected.tokens]
    for step, token in enumerate(expected.tokens):
        assert logprobs.token_logprobs[step] == pytest.approx(float(reference[step, token]), abs=LOGPROB_TOLERANCE)
        best = torch.topk(reference[step], 3)
        want = {default_llm.detokenize([int(t)]): float(v) for t, v in zip(best.indices, best.values)}
        assert logprobs.top_logprobs[step] == pytest.approx(want, abs=LOGPROB_TOLERANCE)
    assert logprobs.text_offset == [len(default_llm.detokenize(expected.tokens[:i])) for i in range(6)]

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model_id, messages=messages, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    ids = default_llm.chat_prompt(messages)
    tokens = default_llm.complete(ids, max_tokens=5, temperature=0).tokens
    reference = _log_softmax(default_llm, ids + tokens)[len(ids) - 1 : -1]
    content = chat.choices[0].logprobs.content
    assert len(content) == len(tokens)
    for step, (entry, token) in enumerate(zip(content, tokens)):
        assert entry.logprob == pytest.approx(float(reference[step, token]), abs=LOGPROB_TOLERANCE)
        assert bytes(entry.bytes).decode() == entry.token == default_llm.detokenize([token])
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(torch.topk(reference[step], 2).values.tolist(),
                                                                       abs=LOGPROB_TOLERANCE)
        assert [t.token for t in entry.top_logprobs] == [default_llm.detokenize([int(t)])
                                                         for t in torch.topk(reference[step], 2).indices]


def test_penalties_and_logit_bias_follow_openai_formula(client, model_id, default_llm):
    """Greedy with OpenAI's penalties equals a decode loop over the engine's logits applying the formula
    OpenAI documents: logit - count * frequency_penalty - (count > 0) * presence_penalty + bias."""
    prompt, presence, frequency, bias = "List: apple, apple, apple,", 0.7, 0.9, {11: -5.0}
    ids = default_llm.tokenize(prompt)
    generated: list[int] = []
    engine = default_llm.engine  # prefill, then decode steps, as the server computes them
    engine.release(0)
    row = engine.prefill(0, ids)
    for _ in range(8):
        logits = torch.as_tensor(row).reshape(-1).clone()
        for token, value in bias.items():
            logits[token] += value
        for token in set(generated):
            logits[token] -= generated.count(token) * frequency + presence
        generated.append(int(torch.argmax(logits)))
        if generated[-1] in default_llm.tokenizer.eog_ids:  # the server stops there, the token unwritten
            generated.pop()
            break
        row = engine.decode([(0, generated[-1])])[0]
    engine.release(0)
    answer = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0,
                                       presence_penalty=presence, frequency_penalty=frequency,
                                       logit_bias={str(k): v for k, v in bias.items()}, logprobs=0)
    assert answer.choices[0].logprobs.tokens == [default_llm.detokenize([t]) for t in generated]
    forced = client.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={"284": 100})
    assert forced.choices[0].text == default_llm.detokenize([284] * 4)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                         "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3}}}


def test_json_schema_answer_validates(client, model_id):
    import jsonschema

    messages = [{"role": "user", "content": "Describe a French person as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answer = client.chat.completions.create(model=model_id, messages=messages, temperature=0, max_tokens=100,
                                            response_format=response_format)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model_id, messages=messages, temperature=0, max_tokens=100, response_format=response_format,
        stream=True) if c.choices)
    assert streamed == answer.choices[0].message.content
    sampled = client.chat.completions.create(model=model_id, messages=messages, temperature=1.0, seed=3, max_tokens=100,
                                             n=2, response_format=response_format)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    text = client.completions.create(model=model_id, prompt="A JSON object about Paris:", max_tokens=60, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(text.choices[0].text), dict)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_required_tool_call_parses(client, model_id):
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = client.chat.completions.create(model=model_id, messages=messages, tools=WEATHER, temperature=0,
                                                tool_choice=tool_choice, max_tokens=60)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        parameters = next(t["function"]["parameters"] for t in WEATHER if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), parameters)
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, tools=WEATHER, temperature=0,
                                                 tool_choice="required", max_tokens=60, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].function.name == answer.choices[0].message.tool_calls[0].function.name
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The call and its result go back into the conversation; "none" answers in words.
    follow = messages + [{"role": "assistant", "tool_calls": [c.model_dump() for c in choice.message.tool_calls]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    words = client.chat.completions.create(model=model_id, messages=follow, tools=WEATHER, tool_choice="none",
                                           temperature=0, max_tokens=20)
    assert words.choices[0].message.content and not words.choices[0].message.tool_calls


def test_embeddings(client, model_id, default_llm):
    texts = ["The cat sat on the mat.", "Stock markets fell today."]
    answer = client.embeddings.create(model=model_id, input=texts, encoding_format="float")
    vectors = [d.embedding for d in sorted(answer.data, key=lambda d: d.index)]
    assert np.allclose(vectors, default_llm.embed(texts), atol=1e-6)
    assert answer.usage.prompt_tokens == sum(len(default_llm.tokenize(t)) for t in texts)
    # Without encoding_format the client asks for base64 (float32 bytes) and decodes it itself.
    assert np.allclose(client.embeddings.create(model=model_id, input=texts[0]).data[0].embedding, vectors[0], atol=1e-6)
    ids = client.embeddings.create(model=model_id, input=default_llm.tokenize(texts[1])).data[0].embedding
    assert np.allclose(ids, vectors[1], atol=1e-6)


def test_api_keys(default_llm):
    running = ServerThread(create_app(default_llm, parallel=1, api_keys=["first-key", "second-key"]))
    try:
        for key in ("wrong", "first-ke"):
            with pytest.raises(openai.AuthenticationError) as refused:
                openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0).models.list()
            assert refused.value.status_code == 401 and refused.value.body["type"] == "authentication_error"
        assert_error(httpx.get(f"{running.url}/v1/models"), 401)
        for key in ("first-key", "second-key"):
            assert openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0).models.list().data
        assert httpx.get(f"{running.url}/health").status_code == 200  # probes need no key
    finally:
        running.stop()


def test_latency_histograms(server, client, model_id):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    for name in ("powerinfer_time_to_first_token_seconds", "powerinfer_inter_token_latency_seconds",
                 "powerinfer_queue_wait_seconds"):
        assert families[name].type == "histogram"
        samples = {s.name: s.value for s in families[name].samples if s.name.endswith(("_count", "_sum"))}
        assert samples[f"{name}_count"] > 0 and samples[f"{name}_sum"] > 0
        buckets = [s.value for s in families[name].samples if s.name.endswith("_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == samples[f"{name}_count"]


def test_props_and_slots(server, default_llm, model_id):
    props = httpx.get(f"{server.url}/props").json()
    assert props["total_slots"] == PARALLEL and props["model_path"] == model_id
    assert props["default_generation_settings"]["n_ctx"] == default_llm.n_ctx
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["chat_template"] == default_llm.tokenizer.chat_template
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 1000, "stream": True}) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        slots = httpx.get(f"{server.url}/slots").json()
        assert [s["id"] for s in slots] == list(range(PARALLEL))
        busy = [s for s in slots if s["is_processing"]]
        assert len(busy) == 1 and busy[0]["n_tokens"] > 0 and busy[0]["n_ctx"] == default_llm.n_ctx
    wait_idle(server)
    assert not any(s["is_processing"] for s in httpx.get(f"{server.url}/slots").json())


def test_unknown_fields_are_ignored_but_unsupported_ones_refused(server):
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                    json={"prompt": "x", "max_tokens": 1, "my_client_tag": 3, "store": False, "user": "u1"})
    assert ok.status_code == 200, ok.text
    error = assert_error(httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "content", "content": "x"},
        "store": True}), 400, "prediction")
    assert "prediction" in error["message"] and "store" in error["message"]


# ---------------------------------------------------------------- batching


def test_mailbox_wakes_the_loop_once_per_batch_and_keeps_order():
    async def scenario() -> tuple[list, int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wake_ups
            wake_ups += 1
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        box, queues = Mailbox.of(loop), [asyncio.Queue(), asyncio.Queue()]

        def step() -> None:
            for i in range(10):
                box.put(queues[i % 2], Event(str(i)))
            box.wake()
            box.wake()  # nothing new: no second wake-up

        poster = threading.Thread(target=step)
        poster.start()
        poster.join()
        received = [[(await q.get()).text for _ in range(5)] for q in queues]
        return received, wake_ups

    received, wake_ups = asyncio.run(scenario())
    assert received == [["0", "2", "4", "6", "8"], ["1", "3", "5", "7", "9"]]
    assert wake_ups == 1


def test_mailbox_of_a_closed_loop_refuses_events():
    loop = asyncio.new_event_loop()
    box = Mailbox.of(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        box.put(asyncio.Queue(), Event("late"))


def test_scheduler_flushes_once_per_step_not_per_event(default_llm):
    """Three requests decoded together, one receiver: their events are flushed once per step."""
    scheduler = Scheduler(Engine(default_llm.model, 256, n_slots=3))
    log: list[str] = []
    finished = threading.Semaphore(0)

    def deliver(event: Event) -> None:
        log.append("event")
        if event.final:
            finished.release()

    def flush() -> None:  # shared, as the server's requests share their event loop's mailbox
        log.append("flush")

    try:
        for prompt in PROMPTS[:3]:
            scheduler.submit(Request(default_llm.new_sequence(prompt, 6, temperature=0), deliver, flush))
        assert all(finished.acquire(timeout=60) for _ in range(3))
    finally:
        scheduler.close()
    events, flushes = log.count("event"), log.count("flush")
    # 6 tokens each: at most 3 prefill rounds and 7 decode steps (the requests may join one by one)
    assert events == 18 and 6 <= flushes <= 10
    assert log[-1] == "flush"  # nothing left unflushed


def test_a_choice_that_ends_at_once_leaves_the_others_going(default_llm):
    """Choices of one request: the first ends with its first token (the fuzz found the others then
    skipped their first token and failed the next step)."""
    scheduler = Scheduler(Engine(default_llm.model, 256, n_slots=2))
    events: list[Event] = []
    done = threading.Semaphore(0)

    def deliver(event: Event) -> None:
        events.append(event)
        if event.final:
            done.release()

    short = default_llm.new_sequence("Once upon a time", 1, temperature=0)
    try:
        scheduler.submit(Request([short, default_llm.new_sequence("Once upon a time", 5, temperature=0)], deliver))
        assert all(done.acquire(timeout=60) for _ in range(2))
    finally:
        scheduler.close()
    assert not [e for e in events if e.error]
    completions = {e.index: e.completion for e in events if e.completion}
    assert completions[1].text == default_llm.generate("Once upon a time", max_tokens=5, temperature=0)
    assert len(completions[0].tokens) == 1


def test_batched_decode_gives_each_row_its_own_logits_exactly(default_llm):
    """What makes batched greedy output equal single-sequence output: bit-identical logits."""
    prompts = [default_llm.tokenize(p) for p in PROMPTS[:5]]
    batched = Engine(default_llm.model, default_llm.n_ctx, n_slots=len(prompts))
    alone = Engine(default_llm.model, default_llm.n_ctx)
    for slot, ids in enumerate(prompts):
        batched.prefill(slot, ids)
    together = batched.decode([(slot, 42 + slot) for slot in range(len(prompts))])
    for slot, ids in enumerate(prompts):
        alone.prefill(0, ids, reuse_prefix=False)
        assert torch.equal(together[slot], alone.decode([(0, 42 + slot)])[0])


def test_concurrent_streams_equal_single_runs(server, client, model_id, default_llm):
    """16 streams at once on 4 slots: some queue, all finish, each with the text it gets alone."""
    expected = [default_llm.generate(p, max_tokens=12, temperature=0) for p in PROMPTS]
    seen = {"active": 0, "queued": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            stats = scheduler_of(server).stats()
            seen["active"], seen["queued"] = max(seen["active"], stats.active), max(seen["queued"], stats.queued)
            time.sleep(0.002)

    def stream(prompt: str) -> str:
        chunks = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(stream, PROMPTS))
    finally:
        done.set()
        watcher.join()
    assert texts == expected
    assert seen["active"] == PARALLEL and seen["queued"] > 0


def test_client_disconnect_frees_slot(server):
    before = scheduler_of(server).stats().generated_tokens
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": True}) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert scheduler_of(server).stats().active == 1
    wait_idle(server)
    assert scheduler_of(server).stats().generated_tokens - before < 200


# ---------------------------------------------------------------- bad requests


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e-9}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "x", "n": PARALLEL + 1}, "n"),  # more choices than slots
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": "abc"}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"12": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"the": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, None),  # beyond the vocabulary
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": "loud"}, "echo"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, None),  # the model has no fill-in-the-middle tokens
    ("/v1/completions", {"prompt": "x", "best_of": 0}, "best_of"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]},
     "modalities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x/y.png"}}]}]}, "messages"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/completions", {"prompt": []}, None),
    ("/v1/completions", {"prompt": [10**9]}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ("/completion", {"prompt": "x", "n_predict": -2}, "n_predict"),
    ("/completion", {"prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
    ("/tokenize", {"content": 7}, "content"),
    ("/detokenize", {"tokens": [-1]}, None),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
]


@pytest.mark.parametrize("route, body, param", BAD_REQUESTS)
def test_bad_requests_get_400(server, route, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert_error(httpx.post(f"{server.url}{route}", content=content, headers=JSON_HEADERS), 400, param)


def test_unknown_route(server):
    assert_error(httpx.get(f"{server.url}/v2/nothing"), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405)


def test_model_is_named_not_located(server, default_llm, model_id):
    """The id is the file's name; a request naming the model by its path is answered as any other
    name is (tests/test_llama_flags.py: --strict-model-name), under the id, so answers never confirm
    where the file lives."""
    assert "/" not in model_id and str(default_llm.path.parent) not in httpx.get(f"{server.url}/v1/models").text
    for name in (str(default_llm.path), str(default_llm.path.with_suffix(""))):
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1},
                            timeout=60)
        assert answer.status_code == 200 and str(default_llm.path.parent) not in answer.text
    answer = httpx.post(f"{server.url}/v1/completions", json={"model": default_llm.path.stem, "prompt": "x",
                                                              "max_tokens": 1}, timeout=60).json()
    assert answer["model"] == model_id


def test_prompt_longer_than_context(server, default_llm):
    prompt = "word " * (default_llm.n_ctx + 10)
    for route, body in [("/v1/completions", {"prompt": prompt}), ("/completion", {"prompt": prompt}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})]:
        error = assert_error(httpx.post(f"{server.url}{route}", json=body, timeout=60), 400)
        assert error["code"] == "context_length_exceeded"


# ---------------------------------------------------------------- hostile requests


def test_huge_stop_string_beside_a_normal_request(server, client, model_id, default_llm):
    """A 5 MB stop string is refused (400 naming `stop`) while another request is answered."""
    expected = default_llm.generate("Water is", max_tokens=8, temperature=0)
    with ThreadPoolExecutor(2) as pool:
        huge = pool.submit(httpx.post, f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": "Water is", "max_tokens": 64, "stop": ["x" * 5_000_000]})
        normal = pool.submit(client.completions.create, model=model_id, prompt="Water is", max_tokens=8, temperature=0)
        assert normal.result(timeout=60).choices[0].text == expected
        assert_error(huge.result(timeout=60), 400, "stop")
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_body_size_limit(server):
    """50 MB gets 413 before it is read: declared by Content-Length, or sent chunked."""
    big = b'{"prompt": "' + b"a" * 50_000_000 + b'"}'
    assert_error(httpx.post(f"{server.url}/v1/completions", content=big, headers=JSON_HEADERS, timeout=60), 413)

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"a" * 1_000_000
        yield b'"}'

    try:
        response = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=JSON_HEADERS, timeout=60)
        assert_error(response, 413)
    except httpx.WriteError:  # the server answered and closed before the client finished sending
        pass
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_post_bodies_must_be_json(server):
    """A cross-site page can POST text/plain or a form without a preflight: both are refused."""
    body = json.dumps({"prompt": "x", "max_tokens": 1})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        assert_error(httpx.post(f"{server.url}/v1/completions", content=body, headers=headers), 415)
    ok = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_foreign_host_is_refused(server):
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example."""
    error = assert_error(httpx.get(f"{server.url}/v1/models", headers={"Host": "evil.example:8080"}), 403)
    assert "evil.example" in error["message"]
    port = server.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(f"{server.url}/health", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("body", [
    json.dumps({"prompt": "a\ud800b"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "a\udfffb"}]}).encode(),
    json.dumps({"prompt": "x", "stop": ["\ud800"]}).encode(),
    b'{"prompt": "a\xff\xfeb"}',  # not UTF-8
])
def test_text_that_is_not_unicode_gets_400(server, body):
    route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    assert_error(httpx.post(f"{server.url}{route}", content=body, headers=JSON_HEADERS, timeout=60), 400)


def test_big_prompt_does_not_block_the_event_loop(server):
    """Tokenizing 7 MB takes seconds; /health answers meanwhile (the tokenizer runs in a worker
    thread and releases the interpreter lock)."""
    prompt = "hello world " * 600_000
    answered_while_busy = 0
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                          timeout=300)
        while not big.done():
            health = httpx.get(f"{server.url}/health", timeout=60)
            answered_while_busy += health.status_code == 200 and not big.done()
            time.sleep(0.05)
        assert assert_error(big.result(), 400)["code"] == "context_length_exceeded"
    assert answered_while_busy > 0


def test_serve_flags(tmp_path):
    from powerinfer.cli import parse_args as parse
    from powerinfer.server.startup import allowed_hosts, api_keys

    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\nsecond\nthird\n")
    assert api_keys(parse(["serve", "--api-key", "first", "--api-key-file", str(keys)])) == ["first", "second", "third"]
    keys.write_text("# none\n")
    with pytest.raises(PowerInferError, match="no API keys"):
        api_keys(parse(["serve", "--api-key-file", str(keys)]))
    assert allowed_hosts(parse(["serve"])) == LOOPBACK_HOSTS
    assert allowed_hosts(parse(["serve", "--host", "127.0.0.2"])) == LOOPBACK_HOSTS | {"127.0.0.2"}
    assert allowed_hosts(parse(["serve", "--host", "0.0.0.0"])) is None
    assert allowed_hosts(parse(["serve", "--allowed-hosts", "api.example, Other.example"])) == {"api.example",
                                                                                             "other.example"}
    assert allowed_hosts(parse(["serve", "--allowed-hosts", "*"])) is None


class StuckDecode:
    """Makes the engine's decode steps block until released: a stuck scheduler step."""

    def __init__(self, engine: Engine):
        self.engine, self.original, self.release = engine, engine.decode, threading.Event()
        engine.decode = self

    def __call__(self, steps):
        self.release.wait(60)
        return self.original(steps)


def test_watchdog_reports_a_stuck_scheduler(default_llm):
    running = ServerThread(create_app(default_llm, parallel=1, watchdog_seconds=0.5))
    try:
        stuck = StuckDecode(scheduler_of(running).engine)
        assert httpx.get(f"{running.url}/health").status_code == 200
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{running.url}/v1/completions", timeout=60,
                                 json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
            deadline = time.monotonic() + 30
            while (health := httpx.get(f"{running.url}/health")).status_code == 200:
                assert time.monotonic() < deadline, "the watchdog never fired"
                time.sleep(0.05)
            assert health.status_code == 503 and health.json() == {"status": "stalled"}
            stuck.release.set()
            assert answer.result(timeout=60).status_code == 200
        assert httpx.get(f"{running.url}/health").status_code == 200
    finally:
        running.stop()


STUCK_SERVE = """
import sys, threading
from powerinfer import cli
from powerinfer.runtime.engine import Engine
calls = []
original = Engine.decode
def decode(self, steps):
    calls.append(1)
    if len(calls) > 2:
        threading.Event().wait()  # stuck for good
    return original(self, steps)
Engine.decode = decode
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_ends_open_streams_and_exits(default_model):
    """A stream whose scheduler step never ends: SIGTERM gives it an error event and the process
    exits within seconds (it used to wait for the step forever)."""
    process = serve_command("-m", str(default_model), "--port", "0", "--parallel", "1", "-c", "256", code=STUCK_SERVE)
    try:
        url = serving_url(process)
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"prompt": "Once upon a time", "max_tokens": 100, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:  # generating, and then stuck
                        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
        error = json.loads(events[-1])["error"]
        assert error["type"] == "unavailable_error" and "shutting down" in error["message"]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
TOKEN_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=6)
# Values a client could well send; the fuzz mixes them with arbitrary JSON.
VALID = {
    "prompt": st.text(max_size=40) | TOKEN_IDS,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=30)}), min_size=1, max_size=3),
    "content": st.text(max_size=40),
    "tokens": TOKEN_IDS,
    "temperature": st.just(0.0) | st.floats(0.001, 3),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 100),
    "min_p": st.floats(0, 1),
    "repeat_penalty": st.floats(0.5, 2),
    "seed": st.integers(-5, 2**64 - 1),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3),
    "stream": st.booleans(),
    "model": st.none() | st.text(max_size=10),
    "n": st.just(1) | st.integers(0, 2),
    "add_special": st.booleans(),
}
# Present on every body and never a large or unlimited (-1) count: generation stays short.
LIMITS = st.integers(0, 4) | st.integers(-5, -2) | st.text(max_size=3) | st.floats(0.5, 2.5) | st.lists(st.integers(), max_size=2)
LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "n_predict")


@st.composite
def bodies(draw) -> dict:
    limits = draw(st.fixed_dictionaries({key: st.integers(0, 4) for key in LIMIT_KEYS}))
    required = {key: VALID[key] for key in ("prompt", "messages", "content", "tokens")}  # one per route
    fields = draw(st.fixed_dictionaries(required, optional={k: v for k, v in VALID.items() if k not in required}))
    for key in draw(st.lists(st.sampled_from(sorted(VALID)), max_size=2)):  # some fields become arbitrary JSON
        fields[key] = draw(JSON)
    for key in draw(st.lists(st.sampled_from(LIMIT_KEYS), max_size=1)):
        limits[key] = draw(LIMITS)
    return {**fields, **limits}


ROUTES = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/completion", "/tokenize", "/detokenize"])


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=ROUTES, body=bodies() | JSON)
def test_fuzzed_bodies_never_fail_the_server(server, route, body):
    response = httpx.post(f"{server.url}{route}", content=json.dumps(body).encode(), headers=JSON_HEADERS, timeout=60)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    wait_idle(server)
    assert httpx.get(f"{server.url}/health").status_code == 200


SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SMALL_SCHEMA}}
# Every field of both OpenAI request schemas: values a client could well send (mixed below with
# arbitrary JSON). Limits stay small so that generation is short.
OPENAI_FIELDS = {
    "model": st.none() | st.just("SmolLM2-135M-Instruct.Q4_1") | st.text(max_size=10),
    "max_tokens": st.none() | st.integers(0, 3),
    "temperature": st.just(0.0) | st.floats(0.001, 3),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 100),
    "min_p": st.floats(0, 1),
    "repeat_penalty": st.floats(0.5, 2),
    "repeat_last_n": st.integers(0, 100),
    "presence_penalty": st.floats(-2, 2) | st.text(max_size=3),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "seed": st.integers(-5, 2**64 - 1),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3),
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"name": "a", "schema": SMALL_SCHEMA}}]),
    "user": st.text(max_size=5),
    "guided_json": st.none() | st.just(SMALL_SCHEMA), "guided_regex": st.none() | st.just("[a-c]{1,3}"),
    "guided_choice": st.none() | st.just(["x", "y"]), "guided_grammar": st.none() | st.just('start: "a"'),
    "guided_decoding_backend": st.none() | st.text(max_size=5), "guided_whitespace_pattern": st.none() | JSON,
}
COMPLETION_FIELDS = {
    "prompt": st.text(max_size=30) | TOKEN_IDS,
    "logprobs": st.none() | st.integers(0, 5),
    "suffix": st.none() | st.text(max_size=3),
    "echo": st.booleans(),
    "best_of": st.none() | st.integers(1, 2),
}
CHAT_FIELDS = {
    "messages": VALID["messages"],
    "max_completion_tokens": st.none() | st.integers(0, 3),
    "logprobs": st.booleans(),
    "top_logprobs": st.none() | st.integers(0, 3),
    "tools": st.none() | st.just([TOOL]),
    "tool_choice": st.sampled_from([None, "none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "parallel_tool_calls": st.booleans(),
    **{name: st.none() | JSON for name in schemas.ChatRequest.UNSUPPORTED},
}


def test_fuzz_covers_every_field():
    for model, fields in ((schemas.CompletionRequest, {**OPENAI_FIELDS, **COMPLETION_FIELDS}),
                          (schemas.ChatRequest, {**OPENAI_FIELDS, **CHAT_FIELDS})):
        assert set(fields) == {f.alias or name for name, f in model.model_fields.items()} | set(model.UNSUPPORTED)


@st.composite
def openai_bodies(draw, chat: bool) -> dict:
    fields = {**OPENAI_FIELDS, **(CHAT_FIELDS if chat else COMPLETION_FIELDS)}
    required = "messages" if chat else "prompt"
    body = draw(st.fixed_dictionaries({required: fields[required]},
                                      optional={k: v for k, v in fields.items() if k != required}))
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2)):  # some become arbitrary JSON
        body[key] = draw(JSON)
    if body.get("max_tokens") is None or isinstance(body["max_tokens"], int):  # None: until the context ends
        body["max_tokens"] = draw(st.integers(0, 3))
    if chat and "max_completion_tokens" in body and not isinstance(body["max_completion_tokens"], int):
        body["max_completion_tokens"] = 2
    return body


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), data=st.data())
def test_fuzzed_openai_requests(server, chat, data):
    """Never a 5xx, and never a 200 for a field we do not implement."""
    body = data.draw(openai_bodies(chat))
    route = "/v1/chat/completions" if chat else "/v1/completions"
    model = schemas.ChatRequest if chat else schemas.CompletionRequest
    response = httpx.post(f"{server.url}{route}", content=json.dumps(body).encode(), headers=JSON_HEADERS, timeout=60)
    assert response.status_code < 500, response.text
    if any(k in body and not harmless(body[k]) for k, harmless in model.UNSUPPORTED.items()):
        assert response.status_code == 400, response.text
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    wait_idle(server)


# ---------------------------------------------------------------- startup


def test_health_is_503_while_loading(default_llm):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return default_llm

    loading = ServerThread(create_app(slow_load, parallel=1))
    try:
        assert_error(httpx.get(f"{loading.url}/v1/models"), 503)
        assert httpx.get(f"{loading.url}/health").status_code == 503
        release.set()
        deadline = time.monotonic() + 10
        while httpx.get(f"{loading.url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        loading.stop()


def test_load_failure_is_reported():
    failures = []

    def broken():
        raise PowerInferError("model.gguf: no such file")

    failing = ServerThread(create_app(broken, on_load_error=failures.append))
    try:
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert httpx.get(f"{failing.url}/health").json() == {"status": "error"}
    finally:
        failing.stop()


def test_serve_command_missing_model(tmp_path):
    process = serve_command("-m", str(tmp_path / "none.gguf"), "--port", "0")
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    assert stderr.strip().splitlines() == [f"powerinfer serve: error: {tmp_path / 'none.gguf'}: no such file"]


def test_serve_command_answers(default_model, default_llm):
    process = serve_command("-m", str(default_model), "--port", "0", "--parallel", "2", "-c", "256")
    try:
        url = serving_url(process)
        body = httpx.post(f"{url}/completion", json={"prompt": "Once upon a time", "n_predict": 8, "temperature": 0},
                          timeout=60).json()
        assert body["content"] == default_llm.generate("Once upon a time", max_tokens=8, temperature=0)
    finally:
        process.terminate()
        process.wait(timeout=30)
