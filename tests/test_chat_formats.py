"""Built-in chat templates: rendered as transformers renders the same template, chosen for files
without one by architecture and tokens, and chosen by hand with --chat-template / LLM(chat_template=)."""

from __future__ import annotations

import pytest

from powerinfer.chat_formats import BUILT_IN, built_in_name, chosen_template, detect
from powerinfer.chat_template import ChatTemplate
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.errors import PowerInferError
from powerinfer.gguf import open_gguf
from powerinfer.tokenizer import Tokenizer

from helpers import assert_one_line_error, powerinfer

CONVERSATIONS = {
    "with a system message": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi <there> "},
                              {"role": "assistant", "content": "Hello! "}, {"role": "user", "content": "A colour?"}],
    "without": [{"role": "user", "content": "What is 2+2?"}],
}
# The marker each format's assistant turn opens with (the text the model was tuned to continue).
ASSISTANT_OPENS = {"chatml": "<|im_start|>assistant\n", "qwen": "<|im_start|>assistant\n",
                   "gemma": "<start_of_turn>model\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                   "phi3": "<|assistant|>\n", "llama2": " [/INST]"}


def tiny_tokenizer(template: str):
    """A transformers tokenizer that carries `template` (its vocabulary does not matter here)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    backend = Backend(models.WordLevel({"<unk>": 0, "<bos>": 1, "<eos>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   chat_template=template)


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(BUILT_IN))
def test_built_in_templates_render_as_transformers(name, conversation, generation_prompt):
    messages = CONVERSATIONS[conversation]
    expected = tiny_tokenizer(BUILT_IN[name]).apply_chat_template(messages, tokenize=False,
                                                                   add_generation_prompt=generation_prompt)
    ours = ChatTemplate(BUILT_IN[name]).render(messages=messages, add_generation_prompt=generation_prompt,
                                               bos_token="<bos>", eos_token="<eos>")
    assert ours == expected
    assert ours.endswith(ASSISTANT_OPENS[name]) == (generation_prompt or name == "llama2")
    assert "A colour?" in ours or "What is 2+2?" in ours


@pytest.mark.parametrize("architecture, tokens, expected", [
    ("gemma3", set(), "gemma"),  # Gemma 3 270M's file: no template, its architecture says it
    ("llama", {"<start_of_turn>", "<end_of_turn>"}, "gemma"),
    ("llama", {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}, "llama3"),
    ("phi3", {"<|assistant|>", "<|end|>", "<|user|>"}, "phi3"),
    ("qwen2", {"<|im_start|>", "<|im_end|>"}, "qwen"),
    ("llama", {"<|im_start|>", "<|im_end|>"}, "chatml"),
    ("falcon", set(), "chatml"),  # llama.cpp's fallback
])
def test_the_format_follows_architecture_and_tokens(architecture, tokens, expected):
    assert detect(architecture, tokens.__contains__) == expected


def test_names_files_and_text(tmp_path):
    assert built_in_name("Llama-3") == "llama3" and built_in_name("CHATML") == "chatml" and built_in_name("x") is None
    assert chosen_template("gemma") == (BUILT_IN["gemma"], "built-in gemma")
    template = tmp_path / "mine.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert chosen_template(str(template)) == ("{{ messages[0]['content'] }}", str(template))
    assert chosen_template("{{ 'x' }}")[0] == "{{ 'x' }}"
    with pytest.raises(PowerInferError, match="neither a built-in .*gemma.* nor a file"):
        chosen_template("nonsense")


@pytest.fixture(scope="module")
def untemplated_model(default_model, tmp_path_factory):
    """The default model without its chat template (as Gemma 3 270M's file comes)."""
    source = gguf_source(default_model)
    del source.typed_metadata["tokenizer.chat_template"]
    path = tmp_path_factory.mktemp("untemplated") / "no-template.gguf"
    write_model(source, path, progress=False)
    return path


def test_a_file_without_a_template_gets_the_built_in_one(untemplated_model, default_model):
    tokenizer = Tokenizer.from_gguf(open_gguf(untemplated_model))
    assert (tokenizer.chat_template, tokenizer.chat_template_origin) == (BUILT_IN["chatml"], "built-in chatml")
    # SmolLM2's vocabulary, read as a Gemma would be: the architecture decides
    assert detect("gemma3", lambda piece: tokenizer.token_id(piece) is not None) == "gemma"
    assert Tokenizer.from_gguf(open_gguf(default_model)).chat_template_origin == "the model file"


def test_chat_says_which_template_it_uses(untemplated_model):
    result = powerinfer("chat", "-m", str(untemplated_model), "-n", "2", "--temp", "0", stdin="hi\n")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "chat template" in line]
    assert notes == ["powerinfer: no-template.gguf has no chat template: using the built-in chatml template "
                     "(--chat-template NAME|FILE for another)"]


@pytest.mark.parametrize("command", [["chat"], ["run", "-cnv"]])
def test_chat_template_flag(default_model, default_llm, command, tmp_path):
    from powerinfer import LLM

    expected = LLM(default_model, chat_template="llama2").chat([{"role": "user", "content": "Name a colour."}],
                                                               max_tokens=6, temperature=0)
    assert expected != default_llm.chat([{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0)
    template = tmp_path / "llama2.jinja"
    template.write_text(BUILT_IN["llama2"])
    for spec in ("llama2", str(template)):
        result = powerinfer(*command, "-m", str(default_model), "--chat-template", spec, "--jinja", "-n", "6",
                            "--temp", "0", stdin="Name a colour.\n")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected.strip()
        assert "has no chat template" not in result.stderr


def test_a_bad_chat_template_is_one_line_before_loading(tmp_path):
    assert_one_line_error(powerinfer("chat", "-m", str(tmp_path / "none.gguf"), "--chat-template", "nonsense"),
                          "--chat-template", "neither a built-in")


def test_chat_prompt_has_one_bos(default_model):
    """Templates that write {{ bos_token }} themselves get no second one from tokenizing."""
    from powerinfer import LLM

    llm = LLM(default_model, chat_template="{{ bos_token }}{{ messages[0]['content'] }}")
    llm.tokenizer.add_bos = True  # as a SentencePiece vocabulary (Gemma's) asks for one
    ids = llm.chat_prompt([{"role": "user", "content": "hello"}])
    assert ids.count(llm.tokenizer.bos_id) == 1 and ids[0] == llm.tokenizer.bos_id


def test_serve_takes_a_chat_template(default_model):
    import httpx

    from helpers import serve_command, serving_url

    process = serve_command("-m", str(default_model), "--port", "0", "-c", "256", "--chat-template", "phi3", "--jinja")
    try:
        assert httpx.get(f"{serving_url(process)}/props").json()["chat_template"] == BUILT_IN["phi3"]
    finally:
        process.terminate()
        process.wait(timeout=30)
