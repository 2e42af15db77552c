"""The Python API as llama-cpp-python users write it: its keyword names, `llm(prompt)`, `close()`
and `with`, max_tokens None/-1, tokenize/detokenize's defaults, and arguments checked by name."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer import LLM
from powerinfer.chat_formats import BUILT_IN
from powerinfer.errors import PowerInferError


@pytest.fixture(scope="module")
def aliased(default_model):
    import torch

    threads = torch.get_num_threads()  # n_threads sets torch's, for the whole process
    yield LLM(model_path=str(default_model), n_threads=1, n_ctx=96, chat_format="llama-2")
    torch.set_num_threads(threads)


def test_llama_cpp_python_keywords(aliased, default_model):
    import torch

    assert aliased.path == default_model and aliased.n_ctx == 96 and torch.get_num_threads() == 1
    assert aliased.tokenizer.chat_template == BUILT_IN["llama2"]
    with pytest.raises(PowerInferError, match="give model or model_path, not both"):
        LLM(default_model, model_path=default_model)


def test_calling_the_object_is_create_completion(aliased):
    called = aliased("The capital of France is", max_tokens=4, temperature=0)
    assert called["choices"][0]["text"] == aliased.create_completion("The capital of France is", max_tokens=4,
                                                                     temperature=0)["choices"][0]["text"]
    assert called["object"] == "text_completion"


@pytest.mark.parametrize("limit", [None, -1])
def test_max_tokens_none_or_minus_one_runs_to_the_end_of_the_context(aliased, limit):
    prompt = "Count: one, two, three,"
    n_prompt = len(aliased.tokenize(prompt))
    # a bias against the end of the text keeps it going until the context is full
    bias = {str(i): -100.0 for i in aliased.tokenizer.eog_ids}
    answer = aliased(prompt, max_tokens=limit, temperature=0, logit_bias=bias)
    assert answer["usage"]["completion_tokens"] == aliased.n_ctx - n_prompt
    assert answer["choices"][0]["finish_reason"] == "length"
    completion = aliased.complete(prompt, max_tokens=limit, temperature=0)
    assert completion.prompt_tokens + len(completion.tokens) <= aliased.n_ctx
    assert completion.finish_reason == "stop" or completion.prompt_tokens + len(completion.tokens) == aliased.n_ctx


def test_tokenize_and_detokenize_defaults(aliased):
    """llama-cpp-python's: special tokens' texts are plain text unless special=True, and
    detokenize writes no text for special tokens (Gemma's <bos>) unless special=True."""
    text = "<|im_start|>user\nHi"
    special = aliased.tokenizer.token_id("<|im_start|>")
    assert aliased.tokenize(text, special=True)[0] == special
    plain = aliased.tokenize(text)
    assert special not in plain and aliased.detokenize(plain) == text
    assert aliased.tokenize(text.encode()) == plain  # bytes, as llama-cpp-python takes them
    ids = [special, *aliased.tokenize("Hello", add_bos=False)]
    assert aliased.detokenize(ids) == "Hello" and aliased.detokenize(ids, special=True) == "<|im_start|>Hello"


@pytest.mark.parametrize("call, fragment", [
    (lambda llm: llm.detokenize([-1]), "ids[0]: token id -1 is out of range"),
    (lambda llm: llm.detokenize([10**12]), "ids[0]: token id 1000000000000 is out of range"),
    (lambda llm: llm.detokenize("abc"), "ids must be a sequence of token ids, not str"),
    (lambda llm: llm.detokenize([1.5]), "ids[0] must be an integer token id, not float"),
    (lambda llm: llm.logits([]), "ids is empty"),
    (lambda llm: llm.logits([1, None]), "ids[1] must be an integer token id, not NoneType"),
    (lambda llm: llm.tokenize(42), "text must be str or bytes, not int"),
    (lambda llm: llm.tokenize(b"\xff"), "text is not UTF-8 text"),
    (lambda llm: llm.generate("", max_tokens=2), "prompt is empty"),
    (lambda llm: llm.generate([5, -3], max_tokens=2), "prompt[1]: token id -3 is out of range"),
    (lambda llm: llm.generate("hi", max_tokens=-5), "max_tokens must be an integer >= 0"),
    (lambda llm: llm.generate("hi", max_tokens="many"), "max_tokens must be an integer >= 0"),
    (lambda llm: llm.embed([[]]), "texts: cannot embed an empty text"),
])
def test_bad_arguments_name_themselves(aliased, call, fragment):
    with pytest.raises(PowerInferError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        call(aliased)


def test_numpy_ids_are_ids(aliased):
    ids = np.array(aliased.tokenize("Hello world"), dtype=np.int64)
    assert aliased.detokenize(ids) == "Hello world"


def test_close_and_with(default_model):
    with LLM(model_path=default_model, n_ctx=64) as llm:
        assert llm.generate("Hi", max_tokens=2, temperature=0)
    with pytest.raises(PowerInferError, match="this LLM was closed"):
        llm.generate("Hi", max_tokens=2)
    assert llm.detokenize(llm.tokenize("still here")) == "still here"  # the tokenizer stays
