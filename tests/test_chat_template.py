"""Chat templates: real ones render as transformers renders them; hostile ones fail with one
`ChatTemplateError` line within their budget, never with a traceback, a stall or a memory spike."""

from __future__ import annotations

import tracemalloc

import pytest
from gguf import GGUFValueType

from powerinfer.chat_template import ChatTemplate, RenderBudget
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.errors import ChatTemplateError, PowerInferError
from powerinfer.gguf import open_gguf
from powerinfer.tokenizer import Tokenizer

from helpers import assert_one_line_error, powerinfer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <there> & you"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather <now>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

# Templates in the styles models ship (Llama 3, Mistral, Gemma, a Qwen-like one with tools): loops,
# loop variables, namespace, slicing, raise_exception, tojson, {% break %}.
REAL_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "mistral": (
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}{{ bos_token }}"
        "{% for message in rest %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + (system + '\n\n' if loop.first and system else '') "
        "+ message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"),
    "gemma": (
        "{% set ns = namespace(first=true) %}{% for message in messages %}{% if message['role'] != 'system' %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
        "{% set ns.first = false %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "tools": (
        "{% if tools %}{{ '<|im_start|>system\n# Tools\n<tools>' }}{% for tool in tools %}{{ '\n' }}"
        "{{ tool | tojson }}{% endfor %}{{ '\n</tools><|im_end|>\n' }}{% endif %}"
        "{% for message in messages[::-1] %}{% if message.role == 'user' %}{% set last = loop.revindex0 %}{% break %}"
        "{% endif %}{% endfor %}{% for message in messages %}{{ '<|im_start|>' + message.role + '\n' + message.content"
        " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_reference):
    return smollm2_reference[0]


@pytest.mark.parametrize("name", list(REAL_TEMPLATES))
def test_real_templates_render_as_transformers_renders_them(hf_tokenizer, name):
    template = REAL_TEMPLATES[name]
    expected = hf_tokenizer.apply_chat_template(MESSAGES, chat_template=template, tools=TOOLS, tokenize=False,
                                                add_generation_prompt=True)
    ours = ChatTemplate(template).render(messages=MESSAGES, tools=TOOLS, add_generation_prompt=True,
                                         bos_token=hf_tokenizer.bos_token, eos_token=hf_tokenizer.eos_token)
    assert ours == expected


def test_smollm2_template_through_the_tokenizer_as_transformers(default_model, hf_tokenizer):
    ours = Tokenizer.from_gguf(open_gguf(default_model)).apply_chat_template(MESSAGES)
    assert ours == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


HOSTILE = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "loop iterations"),
    "loop over a long string": ("{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
                                "loop iterations"),
    "recursive loop": ("{% for x in range(1000) recursive %}{{ loop(range(1000)) }}{% endfor %}", "nested deeper"),
    "a gigabyte string": ("{{ ('x' * 10**9) | length }}", "exceeds the render budget"),
    "doubling with +": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}", "exceeds the render budget"),
    "doubling with ~": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s }}", "exceeds the render budget"),
    "a huge power": ("{{ 7 ** 100000 }}", "a power exceeds"),
    "squaring in a loop": ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                           "{% endfor %}", "a product exceeds"),
    "replace with an empty pattern": ("{% set s = 'x' * 100000 %}{{ s.replace('', s) }}", "exceeds the render budget"),
    "join with a long separator": ("{% set s = 'x' * 100000 %}{{ s.join(['a'] * 100000) }}", "exceeds the render budget"),
    "padding": ("{{ 'x'.ljust(10**9) }}", "the number 1000000000"),
    "center filter": ("{{ 'x' | center(10**9) }}", "the number 1000000000"),
    "indent filter": ("{{ ('\n' * 100000) | indent(1000) }}", "exceeds the render budget"),
    "format width": ("{{ '{:>2000000000}'.format(1) }}", "width in a format string"),
    "nested format width": ("{{ '{:>{0[0]}}'.format([2000000000]) }}", "nested fields"),
    "percent width": ("{{ '%*s' % (2000000000, 'x') }}", "the number 2000000000"),
    "sum of lists": ("{{ ([range(1000) | list] * 1000) | sum(start=[]) }}", "adds numbers only"),
    "json indent": ("{{ messages | tojson(indent=100000) }}", "JSON indent"),
    "endless output": ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "an output of more than"),
    "macro recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested deeper than 64"),
    "include": ("{% include 'other.jinja' %}", "cannot include, import or extend"),
    "import": ("{% import 'macros.jinja' as m %}", "cannot include, import or extend"),
    "extends": ("{% extends 'base.jinja' %}", "cannot include, import or extend"),
    "sandbox escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "lipsum": ("{{ lipsum(n=1000000) }}", "lipsum"),
    "python error": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    "syntax error": ("{% for %}", "does not parse"),
    "parser recursion": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not parse"),
    "raise_exception": ("{{ raise_exception('Conversation roles must alternate') }}", "roles must alternate"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_fail_with_one_line_in_bounded_memory(name):
    source, message = HOSTILE[name]
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError, match=message) as error:
            # a deadline far off, so that the limit under test trips first on a loaded machine
            # (tracing slows the render; the deadline has its own test below)
            ChatTemplate(source, RenderBudget(seconds=120)).render(messages=MESSAGES, add_generation_prompt=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(error.value, PowerInferError) and "\n" not in str(error.value)
    assert peak < 64 << 20  # the largest value a template may hold is ~1 M characters


def test_a_slow_render_stops_at_its_deadline():
    """With no time at all, the first step is over the deadline (a timing-free check of the clock)."""
    with pytest.raises(ChatTemplateError, match="took more than"):
        ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", RenderBudget(seconds=0)).render(
            messages=MESSAGES)


def test_budgets_are_per_render():
    template = ChatTemplate("{% for i in range(n) %}x{% endfor %}", RenderBudget(iterations=10))
    assert template.render(n=10) == "x" * 10
    with pytest.raises(ChatTemplateError, match="more than 10 loop iterations"):
        template.render(n=11)
    assert template.render(n=10) == "x" * 10


@pytest.fixture(scope="module")
def looping_model(default_model, tmp_path_factory):
    """The default model with a chat template that never ends."""
    source = gguf_source(default_model)
    source.typed_metadata["tokenizer.chat_template"] = (HOSTILE["nested loops"][0], GGUFValueType.STRING, None)
    path = tmp_path_factory.mktemp("hostile") / "looping-template.gguf"
    write_model(source, path, progress=False)
    return path


def test_hostile_template_is_one_line_on_the_command_line(looping_model):
    assert_one_line_error(powerinfer("chat", "-m", str(looping_model), "-n", "4", stdin="hello\n"),
                          "chat template", "loop iterations")


def test_hostile_template_through_the_api(looping_model):
    from powerinfer import LLM

    llm = LLM(looping_model, n_ctx=256)
    with pytest.raises(ChatTemplateError, match="loop iterations"):
        llm.chat([{"role": "user", "content": "hello"}], max_tokens=4)
    assert llm.generate("Hello", max_tokens=2, temperature=0)  # the model still serves plain prompts
