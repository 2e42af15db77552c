"""What OpenAI, vLLM and lm-evaluation-harness clients send to the server: vLLM's guided decoding
fields, /v1/completions' echo with logprobs, suffix; through the official openai client."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from helpers import assert_error

CITY = {"type": "object", "additionalProperties": False, "required": ["name", "population"],
        "properties": {"name": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}


@pytest.mark.parametrize("chat", [False, True])
def test_vllm_guided_fields_constrain_the_answer(client, model_id, chat):
    def answer(max_tokens: int = 40, **guide) -> str:
        if chat:
            reply = client.chat.completions.create(model=model_id, max_tokens=max_tokens, temperature=0, extra_body=guide,
                                                   messages=[{"role": "user", "content": "Tell me about Paris."}])
            return reply.choices[0].message.content
        return client.completions.create(model=model_id, prompt="Paris is", max_tokens=max_tokens, temperature=0,
                                         extra_body=guide).choices[0].text

    assert answer(guided_choice=["big", "small", "old \"town\""]) in {"big", "small", "old \"town\""}
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", answer(guided_regex=r"[0-9]{3}-[a-z]{2}"))
    jsonschema.validate(json.loads(answer(100, guided_json=CITY)), CITY)
    jsonschema.validate(json.loads(answer(100, guided_json=json.dumps(CITY))), CITY)
    assert answer(guided_grammar='root ::= "yes" | "no"') in {"yes", "no"}  # llama.cpp's GBNF
    assert re.fullmatch(r"a+b", answer(guided_grammar='start: "a"+ "b"', guided_decoding_backend="xgrammar"))


@pytest.mark.parametrize("body, fragment", [
    ({"guided_choice": ["a"], "guided_regex": "a"}, "give one guided_* field at most"),
    ({"guided_regex": "[0-9"}, "grammar"),
    ({"guided_grammar": "??"}, "guided_grammar: not a Lark or GBNF grammar"),
    ({"guided_json": "{not json"}, "guided_json: not a JSON schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "use one or the other"),
    ({"guided_whitespace_pattern": r"\s*"}, "guided_whitespace_pattern"),
])
def test_bad_guides_get_400(server, body, fragment):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=60)
    assert fragment in assert_error(response, 400)["message"]


def test_guided_fields_through_the_python_api(default_llm):
    text = default_llm.create_completion("Paris is", max_tokens=8, temperature=0, guided_choice=["big", "small"])
    assert text["choices"][0]["text"] in {"big", "small"}


def test_echo_with_logprobs_scores_the_prompt_as_llm_logits(client, model_id, default_llm):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0."""
    import torch

    prompt = "The capital of France is Paris"
    answer = client.completions.create(model=model_id, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = answer.choices[0]
    ids = default_llm.tokenize(prompt)
    expected = torch.log_softmax(torch.from_numpy(default_llm.logits(ids)).double(), dim=-1)
    assert choice.text == prompt and choice.logprobs.tokens == [default_llm.detokenize([i]) for i in ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([float(expected[i - 1, ids[i]]) for i in range(1, len(ids))],
                                                               abs=1e-4)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(ids)
    # with generation: the prompt, then the completion; streamed alike
    whole = client.completions.create(model=model_id, prompt=prompt, echo=True, max_tokens=4, temperature=0)
    assert whole.choices[0].text == prompt + default_llm.generate(prompt, max_tokens=4, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=prompt, echo=True, max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    local = default_llm.create_completion(prompt, echo=True, logprobs=2, max_tokens=0)
    assert local["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs)


def test_suffix_needs_fill_in_the_middle_tokens(server, default_model, tmp_path):
    from gguf import GGUFValueType

    from powerinfer import LLM
    from powerinfer.convert.model import gguf_source, write_model

    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "def f(", "suffix": "  return x", "max_tokens": 2})
    assert "no fill-in-the-middle tokens" in assert_error(response, 400)["message"]
    # the same vocabulary, told (as llama.cpp's keys tell it) which tokens mark prefix, suffix and middle
    source = gguf_source(default_model)
    for key, token in (("pre", 3), ("suf", 4), ("mid", 5)):
        source.typed_metadata[f"tokenizer.ggml.fim_{key}_token_id"] = (token, GGUFValueType.UINT32, None)
    path = tmp_path / "fim.gguf"
    write_model(source, path, progress=False)
    llm = LLM(path, n_ctx=256)
    answer = llm.create_completion("def add(a, b):", suffix="\nprint(add(1, 2))", max_tokens=6, temperature=0)
    ids = [3, *llm.tokenize("def add(a, b):", add_bos=False), 4, *llm.tokenize("\nprint(add(1, 2))", add_bos=False), 5]
    assert answer["choices"][0]["text"] == llm.generate(ids, max_tokens=6, temperature=0)
    assert answer["usage"]["prompt_tokens"] == len(ids)


def test_best_of_answers_the_likeliest(client, model_id, default_llm):
    prompt = "Once upon a time"
    every = client.completions.create(model=model_id, prompt=prompt, n=3, max_tokens=5, temperature=1.0, seed=7,
                                      logprobs=0)
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(model=model_id, prompt=prompt, n=1, best_of=3, max_tokens=5, temperature=1.0,
                                     seed=7)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == every.choices[max(range(3), key=mean.__getitem__)].text
    assert best.usage.completion_tokens == every.usage.completion_tokens  # every candidate was generated
    error = httpx.post(f"{client.base_url}completions", json={"prompt": "x", "n": 2, "best_of": 1})
    assert "best_of (1) must be at least n (2)" in assert_error(error, 400)["message"]


def test_a_batch_of_prompts(client, model_id, default_llm):
    """prompt as a list of texts or of token lists: each prompt's n choices, numbered prompt by prompt."""
    prompts = ["The capital of France is", "Water is", "My favourite colour"]
    expected = [default_llm.generate(p, max_tokens=3, temperature=0) for p in prompts]
    answer = client.completions.create(model=model_id, prompt=prompts, n=2, max_tokens=3, temperature=0)
    assert [c.index for c in answer.choices] == list(range(6))
    assert [c.text for c in answer.choices] == [e for e in expected for _ in range(2)]
    assert answer.usage.prompt_tokens == sum(len(default_llm.tokenize(p)) for p in prompts)
    assert answer.usage.completion_tokens == sum(len(default_llm.tokenize(e, add_bos=False)) for e in expected) * 2
    as_ids = client.completions.create(model=model_id, prompt=[default_llm.tokenize(p) for p in prompts], max_tokens=3,
                                       temperature=0)
    assert [c.text for c in as_ids.choices] == expected
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=model_id, prompt=prompts, max_tokens=3, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected
    local = default_llm(prompts, max_tokens=3, temperature=0)
    assert [c["text"] for c in local["choices"]] == expected


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather now in a city",
                "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                               "properties": {"city": {"type": "string", "maxLength": 40}}}}


def test_responses_api_text_and_stream(client, model_id, default_llm):
    """OpenAI's Responses API through the official client's responses.create."""
    expected = default_llm.chat([{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0)
    response = client.responses.create(model=model_id, instructions="Answer briefly.", input="Name a colour.",
                                       max_output_tokens=8, temperature=0)
    assert response.object == "response" and response.output_text == expected
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens <= 8
    events = list(client.responses.create(model=model_id, instructions="Answer briefly.", input="Name a colour.",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_api_tools_and_json_schema(client, model_id):
    called = client.responses.create(model=model_id, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                     tool_choice="required", temperature=0, max_output_tokens=60)
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    # the call's result goes back as an input item, and the model answers in text
    follow = client.responses.create(model=model_id, tools=[WEATHER_TOOL], temperature=0, max_output_tokens=20, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}], tool_choice="none")
    assert follow.output[0].type == "message" and follow.output_text
    streamed = list(client.responses.create(model=model_id, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                            tool_choice="required", temperature=0, max_output_tokens=60, stream=True))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert done[0].type == "function_call" and done[0].arguments == call.arguments
    formatted = client.responses.create(model=model_id, input="Describe Paris as JSON.", temperature=0,
                                        max_output_tokens=100, text={"format": {"type": "json_schema", "name": "city",
                                                                                "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(formatted.output_text), CITY)


@pytest.mark.parametrize("body, fragment", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "n": 2}, "one output"),
    ({"input": []}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "response_format": {"type": "json_object"}},
     "give one"),
])
def test_responses_api_refuses_what_it_does_not_do(server, body, fragment):
    assert fragment in assert_error(httpx.post(f"{server.url}/v1/responses", json=body, timeout=60), 400)["message"]
