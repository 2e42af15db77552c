"""Built-in chat templates, for files that carry none and for `--chat-template NAME`.

Each is a Jinja template in the format its model family was trained on (the format of the
family's own `tokenizer_config.json`; transformers renders the same text, see
tests/test_chat_formats.py). Which one a file without a template gets is read from its architecture
and vocabulary, the way llama.cpp tells formats apart by their marker tokens; ChatML is the
fallback, as it is llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Callable

from powerinfer.errors import PowerInferError
from powerinfer.paths import user_path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2 / Qwen1.5: ChatML with a system message of its own when the conversation brings none.
QWEN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma 1-3: the system message joins the first user turn; the assistant is called "model".
GEMMA = (
    "{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
LLAMA3 = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Llama 2 chat: [INST] turns, the system message in <<SYS>> inside the first one.
LLAMA2 = (
    "{% if messages and messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

BUILT_IN: dict[str, str] = {"chatml": CHATML, "qwen": QWEN, "gemma": GEMMA, "llama3": LLAMA3, "phi3": PHI3,
                            "llama2": LLAMA2}
# Other spellings users bring: llama-cpp-python's chat_format names and llama.cpp's.
ALIASES = {"llama-3": "llama3", "llama-2": "llama2", "phi-3": "phi3", "phi3.5": "phi3", "gemma2": "gemma",
           "gemma3": "gemma", "qwen2": "qwen"}


def detect(architecture: str, has_token: Callable[[str], bool]) -> str:
    """The built-in format for a file without a template: by its marker tokens first (what the
    model was tuned to write), then by its architecture, else ChatML."""
    if has_token("<start_of_turn>") or architecture.startswith("gemma"):
        return "gemma"
    if has_token("<|start_header_id|>") and has_token("<|eot_id|>"):
        return "llama3"
    if has_token("<|assistant|>") and has_token("<|end|>"):
        return "phi3"
    if has_token("<|im_start|>") and architecture == "qwen2":
        return "qwen"
    return "chatml"


def built_in_name(name: str) -> str | None:
    """The built-in template `name` stands for (any case, llama-cpp-python's spellings), if any."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in BUILT_IN else None


def chosen_template(spec: str) -> tuple[str, str]:
    """(Jinja source, where it came from) for `--chat-template` / `LLM(chat_template=...)`: a
    built-in name, a file holding a template, or the template's text itself."""
    name = built_in_name(spec)
    if name is not None:
        return BUILT_IN[name], f"built-in {name}"
    if "{{" in spec or "{%" in spec:
        return spec, "the given template"
    path = user_path(spec)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as error:
            raise PowerInferError(f"chat template {spec}: cannot read: {error}") from None
    raise PowerInferError(f"chat template {spec!r} is neither a built-in ({', '.join(BUILT_IN)}) nor a file")
