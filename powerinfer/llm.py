"""The Python API: `LLM` loads a GGUF model and generates text."""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from powerinfer import arguments
from powerinfer.errors import ContextOverflowError, PowerInferError
from powerinfer.gguf.file_type import file_type_label
from powerinfer.gguf.reader import GGUFFile, open_gguf
from powerinfer.hub import resolve_model
from powerinfer.models import load_model, read_config
from powerinfer.options import (
    DEFAULT_DTYPE,
    DEFAULT_N_BATCH,
    DEFAULT_SPARSITY,
    DTYPES,
    SPARSITY_MODES,
    CacheType,
    DType,
    FFNOptions,
    SparsityMode,
    context_size,
)
from powerinfer.runtime.constraint import Constraint
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.kv_cache import CACHE_TYPES, cache_bytes, check_cache_fits
from powerinfer.runtime.sampling import SamplingParams
from powerinfer.runtime.sequence import Completion, GenerationSequence
from powerinfer.sparse.storage import TARGET_KEY, is_sparsified
from powerinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from powerinfer.placement.planner import GPUIndexMode
    from powerinfer.placement.spec import Placement

Prompt = str | Sequence[int]
Messages = Sequence[dict[str, str]]


class TextStream:
    """Iterates over generated text pieces; `completion` holds the full result once exhausted."""

    def __init__(self, pieces: Iterator[str], sequence: GenerationSequence):
        self._pieces = pieces
        self._sequence = sequence
        self.completion: Completion | None = None

    def __iter__(self) -> Iterator[str]:
        for piece in self._pieces:
            if piece:
                yield piece
        self.completion = self._sequence.completion()


class LLM:
    """A GGUF model ready to generate.

    `model` is a path to a GGUF or PowerInfer GGUF file, or None for the default model (fetched on
    first use). `dtype="float32"` dequantizes all weights to float32: exact arithmetic for checking
    against reference implementations, at several times the memory and a fraction of the speed.
    `cache_type`: what the KV cache holds in CPU memory, "f16" (llama.cpp's default; half the memory)
    or "f32" (the default with dtype="float32"); an accelerator's cache is float16.

    `sparsity`: "auto" computes only the FFN neurons the model's predictors expect to fire, or, in a
    `sparsify` output, only the input channels of each linear above their thresholds (dense when the
    file has neither); "off" computes all of them; "oracle" computes every activation
    and skips the neurons with |activation| <= a per-layer threshold (`thresholds`, else the file's
    calibrated ones, else 0 for ReLU-family models) in the down projection: for verification.

    `vram_budget` (GiB): run each FFN's hottest neurons on the accelerator (`accelerator`, default
    CUDA when present; "cpu" runs the same split on the CPU, for tests), placed by the solver from
    activation statistics (`activations` directory, else activation/ next to the model, else
    uniform) or read from `<model>.generated.gpuidx`; `gpu_index`: "reuse" the index while the
    budget covers it, "reset" to rebuild it, "disable" to keep FFNs on the CPU. See docs/hybrid.md.
    `n_gpu_layers` instead offloads the last N layers whole, as llama.cpp's -ngl does.
    `parallel`: the KV-cache slots a server will run (the placement budgets their cache).
    `chat_template`: how chats are rendered instead of the file's template (or the built-in one
    chosen for a file without): a built-in name (chatml, gemma, llama3, phi3, qwen, llama2), a
    template file, or the Jinja text itself.

    The loaded model is shared: `engine` (made on first use) holds this object's own KV cache, and
    `new_engine` makes others over the same weights (the server's slots).
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, threads: int | None = None,
                 model_path: str | os.PathLike[str] | None = None, n_threads: int | None = None,
                 chat_format: str | None = None,
                 n_ctx: int | None = None, n_batch: int = DEFAULT_N_BATCH, dtype: DType = DEFAULT_DTYPE,
                 sparsity: SparsityMode = DEFAULT_SPARSITY, thresholds: Sequence[float] | None = None,
                 vram_budget: float | None = None, n_gpu_layers: int | None = None, gpu_index: GPUIndexMode = "reuse",
                 activations: str | os.PathLike[str] | None = None, accelerator: str | torch.device | None = None,
                 parallel: int = 1, cache_type: CacheType | None = None, chat_template: str | None = None):
        model = _one_of("model", model, "model_path", model_path)  # llama-cpp-python's names too
        threads = _one_of("threads", threads, "n_threads", n_threads)
        chat_template = _one_of("chat_template", chat_template, "chat_format", chat_format)
        if dtype not in DTYPES:
            raise PowerInferError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
        if cache_type is not None and cache_type not in CACHE_TYPES:
            raise PowerInferError(f"unknown cache type {cache_type!r} (expected one of {', '.join(CACHE_TYPES)})")
        self.cache_type = cache_type  # None: the engine's default for the model (f16; f32 in float32 mode)
        if sparsity not in SPARSITY_MODES:
            raise PowerInferError(f"unknown sparsity {sparsity!r} (expected one of {', '.join(SPARSITY_MODES)})")
        if parallel < 1:
            raise PowerInferError("parallel must be >= 1")
        if threads is not None:
            if threads < 1:
                raise PowerInferError("threads must be >= 1")
            torch.set_num_threads(threads)
        self.path = resolve_model(model)
        started = time.perf_counter()
        gguf = open_gguf(self.path)
        self.config = read_config(gguf)  # rejects unsupported architectures before any work
        self.tokenizer = Tokenizer.from_gguf(gguf)
        if chat_template is not None:
            self.tokenizer.use_chat_template(chat_template)
        gguf.drop_metadata("tokenizer.ggml.")  # the vocabulary is the tokenizer's now
        self.n_ctx = context_size(n_ctx, self.config.n_ctx_train)
        self.n_batch = n_batch
        if self.n_ctx < 1:
            raise PowerInferError("n_ctx must be >= 1")
        # Before anything sized by the context is allocated: a cache that can never be held is one line.
        check_cache_fits(cache_bytes(self.config.n_layers, parallel, self.config.n_head_kv, self.n_ctx,
                                     self.config.head_dim, torch.float16), parallel, self.n_ctx)
        if thresholds is not None and len(thresholds) != self.config.n_ffn_units:
            raise PowerInferError(f"{len(thresholds)} thresholds given for a model of {self.config.n_ffn_units} FFNs "
                                  "(one per layer, or per expert)")
        placed = vram_budget is not None or n_gpu_layers is not None
        if placed and is_sparsified(gguf):
            raise PowerInferError(f"{self.path}: a sparsified file runs on the CPU only; place its dense source instead")
        if placed and dtype == "float32":
            raise PowerInferError("placing weights on an accelerator needs dtype 'auto' (float32 mode runs on the CPU)")
        self.placement = self._placement(gguf, parallel, vram_budget, n_gpu_layers, gpu_index, activations,
                                         accelerator) if placed else None
        options = FFNOptions(sparsity, dtype == "float32", tuple(thresholds) if thresholds is not None else None)
        self.model = load_model(gguf, self.n_ctx, options, self.config)
        if self.placement is not None:
            from powerinfer.placement.apply import apply_placement

            apply_placement(self.model, self.placement)
        self.file_size = gguf.file_size
        self.n_params = sum(t.n_elements for t in gguf.tensors.values())
        self.quant_label = file_type_label(gguf)  # llama.cpp's label, e.g. "Q4_K - Medium"
        predicted = any(unit.ffn.mode == "auto" for unit in self.model.ffn_units())
        self.sparsity = sparsity if sparsity != "auto" else "predictors" if predicted else \
            f"inputs {gguf.get(TARGET_KEY):.0%}" if is_sparsified(gguf) else "off"
        self.load_seconds = time.perf_counter() - started

    def summary(self) -> str:
        """One line about the loaded model, as `run` prints it at load."""
        return (f"{self.config.name}: {self.config.architecture}, {self.n_params / 1e6:.2f} M parameters, "
                f"{self.quant_label}, {self.file_size / 2**20:.2f} MiB, context {self.n_ctx} "
                f"(trained {self.config.n_ctx_train}), {torch.get_num_threads()} threads, sparsity {self.sparsity}, "
                f"loaded in {self.load_seconds:.2f} s")

    def _placement(self, gguf: GGUFFile, parallel: int, vram_budget: float | None, n_gpu_layers: int | None,
                   gpu_index: GPUIndexMode, activations, accelerator) -> Placement | None:
        # imported here: runs without an accelerator never load the solver
        from powerinfer.placement.planner import choose_placement

        return choose_placement(gguf, self.config, self.path, self.n_ctx, parallel, vram_budget=vram_budget,
                                n_gpu_layers=n_gpu_layers, gpu_index=gpu_index, activations=activations,
                                accelerator=accelerator)

    @cached_property
    def engine(self) -> Engine:
        """This object's own single-slot engine (its KV cache is allocated on first use)."""
        return self.new_engine(1)

    def new_engine(self, n_slots: int) -> Engine:
        """An engine with `n_slots` KV-cache slots over this model's weights."""
        if self.model is None:
            raise PowerInferError("this LLM was closed")
        return Engine(self.model, self.n_ctx, n_slots=n_slots, n_batch=self.n_batch, cache_type=self.cache_type)

    def close(self) -> None:
        """Let go of the weights and KV caches now rather than when the object is collected
        (llama-cpp-python's `close`); the tokenizer stays usable."""
        self.__dict__.pop("engine", None)
        self.model = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tokens -------------------------------------------------------------------------------

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of `text` (str or UTF-8 bytes), with llama-cpp-python's defaults: a BOS token
        first when `add_bos` and the model asks for one; special tokens' texts ("<|im_start|>")
        are read as special tokens only with `special`, else as plain text."""
        return self.tokenizer.encode(arguments.text(text, "text"), add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        """The text of `ids`; special tokens (<bos>, <|im_end|>) give text only with `special`, as in
        llama-cpp-python."""
        return self.tokenizer.decode(arguments.token_ids(ids, "ids", self.tokenizer.n_vocab), skip_special=not special)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Next-token logits at every position: float32 [len(ids), n_vocab]."""
        return self.engine.all_logits(self._check_ids(ids, "ids", allow_empty=False)).numpy()

    def _check_ids(self, ids: Sequence[int], name: str = "prompt", allow_empty: bool = True) -> list[int]:
        return arguments.token_ids(ids, name, self.config.n_vocab, allow_empty)

    # -- generation ---------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self._check_ids(prompt)
        if not ids:
            raise PowerInferError("prompt is empty")
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(f"prompt of {len(ids)} tokens does not fit in the context of {self.n_ctx} tokens")
        return ids

    def _sequence(self, prompt: Prompt, max_tokens: int | None, stop: Sequence[str] | str | None,
                  sampling: SamplingParams, logprobs: int | None = None,
                  constraint: Constraint | None = None) -> GenerationSequence:
        max_tokens = arguments.max_tokens(max_tokens, self.n_ctx)
        ids = self._prompt_ids(prompt)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return GenerationSequence(ids, self.tokenizer, sampling, max_tokens, stops, context_left=self.n_ctx - len(ids),
                                  logprobs=logprobs, constraint=constraint)

    def new_sequence(self, prompt: Prompt, max_tokens: int | None = 128, stop: Sequence[str] | str | None = None,
                     logprobs: int | None = None, constraint: Constraint | None = None,
                     **sampling) -> GenerationSequence:
        """The checked generation `generate` would run, for an engine of one's own (the server's
        scheduler runs many of them on one multi-slot engine); `logprobs` and `constraint` as
        `GenerationSequence` takes them."""
        return self._sequence(prompt, max_tokens, stop, SamplingParams(**sampling), logprobs, constraint)

    def _run(self, sequence: GenerationSequence, cache_prompt: bool, slot: int = 0) -> Iterator[str]:
        timings = sequence.timings
        started = time.perf_counter()
        logits = self.engine.prefill(slot, sequence.prompt, reuse_prefix=cache_prompt)
        timings.prompt_seconds = time.perf_counter() - started
        if not sequence.finished:  # max_tokens=0 evaluates the prompt only
            yield sequence.accept(logits)
        sparse = [block.ffn for block in self.model.blocks if hasattr(block.ffn, "last_active")]
        while not sequence.finished:
            started = time.perf_counter()
            logits = self.engine.decode([(slot, sequence.last_token)])[0]
            timings.decode_seconds += time.perf_counter() - started
            timings.decode_steps += 1
            # each sparse FFN notes the neurons it computed for this token
            timings.ffn_neurons_computed += sum(ffn.last_active for ffn in sparse)
            timings.ffn_neurons += sum(ffn.n_ff for ffn in sparse)
            yield sequence.accept(logits)

    def complete(self, prompt: Prompt, max_tokens: int | None = 128, stop: Sequence[str] | str | None = None,
                 cache_prompt: bool = False, **sampling) -> Completion:
        """Generate a continuation and return it with token counts, finish reason and timings.

        `cache_prompt` skips recomputing the part of the prompt the previous call already
        evaluated (useful for growing chats); it makes seeded sampling reproducible only to rounding.
        """
        sequence = self._sequence(prompt, max_tokens, stop, SamplingParams(**sampling))
        for _ in self._run(sequence, cache_prompt):
            pass
        return sequence.completion()

    def generate(self, prompt: Prompt, max_tokens: int | None = 128, stop: Sequence[str] | str | None = None,
                 cache_prompt: bool = False, **sampling) -> str:
        """The generated text. Sampling keywords: temperature, top_k, top_p, min_p, repeat_penalty,
        repeat_last_n, seed (see `SamplingParams`)."""
        return self.complete(prompt, max_tokens, stop, cache_prompt, **sampling).text

    def generate_stream(self, prompt: Prompt, max_tokens: int | None = 128, stop: Sequence[str] | str | None = None,
                        cache_prompt: bool = False, **sampling) -> TextStream:
        """Like `generate`, but yields text pieces as they are produced."""
        sequence = self._sequence(prompt, max_tokens, stop, SamplingParams(**sampling))
        return TextStream(self._run(sequence, cache_prompt), sequence)

    def chat_prompt(self, messages: Messages, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for a reply
        (`tools`: OpenAI function definitions, for templates that render them)."""
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tools=tools)
        bos = self.tokenizer.bos_id
        # templates that write {{ bos_token }} themselves (Gemma's, Llama 3's) get no second one
        starts_with_bos = bos is not None and 0 <= bos < self.tokenizer.n_vocab and text.startswith(self.tokenizer.piece(bos))
        return self.tokenizer.encode(text, add_bos=not starts_with_bos)

    def chat(self, messages: Messages, max_tokens: int | None = 256, stop: Sequence[str] | str | None = None,
             cache_prompt: bool = False, **sampling) -> str:
        """The assistant's reply to `messages` ([{"role": ..., "content": ...}, ...])."""
        return self.generate(self.chat_prompt(messages), max_tokens, stop, cache_prompt, **sampling)

    def chat_stream(self, messages: Messages, max_tokens: int | None = 256, stop: Sequence[str] | str | None = None,
                    cache_prompt: bool = False, **sampling) -> TextStream:
        return self.generate_stream(self.chat_prompt(messages), max_tokens, stop, cache_prompt, **sampling)

    # -- OpenAI-shaped API (llama-cpp-python's `Llama` methods) ---------------------------------

    def create_completion(self, prompt: str | list[int], **fields) -> dict | Iterator[dict]:
        """An OpenAI text completion as a dict, or with `stream=True` an iterator of chunk dicts.
        `fields` are the server's /v1/completions fields with the same defaults (max_tokens 16,
        temperature 1): n, logprobs, stop, seed, presence_penalty, response_format, ..."""
        from powerinfer.api.local import create_completion

        if fields.get("max_tokens", 0) in (None, -1):  # llama-cpp-python's: to the end of the context
            fields["max_tokens"] = self.n_ctx
        return create_completion(self, {"prompt": prompt, **fields})

    def __call__(self, prompt: str | list[int], **fields) -> dict | Iterator[dict]:
        """`create_completion`, as llama-cpp-python's `llm(prompt, ...)`."""
        return self.create_completion(prompt, **fields)

    def create_chat_completion(self, messages: Messages, **fields) -> dict | Iterator[dict]:
        """An OpenAI chat completion as a dict, or with `stream=True` an iterator of chunk dicts;
        `fields` as the server's /v1/chat/completions takes them (tools, response_format, logprobs, n, ...)."""
        from powerinfer.api.local import create_chat_completion

        if fields.get("max_tokens", 0) == -1:  # None runs to the end of the turn already
            fields["max_tokens"] = None
        return create_chat_completion(self, {"messages": list(messages), **fields})

    def embed(self, texts: str | Sequence[str] | Sequence[Sequence[int]]) -> list[list[float]]:
        """One unit-length vector per text (or token-id list): the final normalized hidden states,
        pooled as the file's `<arch>.pooling_type` says (mean when it says nothing)."""
        inputs = [texts] if isinstance(texts, str) else list(texts)
        return self.embed_with_counts(inputs)[0]

    def embed_with_counts(self, inputs: Sequence[str | Sequence[int]]) -> tuple[list[list[float]], int]:
        """`embed`'s vectors and the number of tokens they took."""
        token_lists = self.embedding_ids(inputs)
        steps = self.embedding_steps(token_lists)
        next(steps)
        try:
            while True:
                steps.send(self.n_batch)
        except StopIteration as done:
            return done.value, sum(map(len, token_lists))

    def embedding_ids(self, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """The token ids of each text (or token-id list) to embed, checked."""
        if not inputs:
            raise PowerInferError("nothing to embed")
        token_lists = []
        for item in inputs:
            ids = self.tokenizer.encode(item) if isinstance(item, str) else self._check_ids(item, "texts")
            if not ids:
                raise PowerInferError("texts: cannot embed an empty text")
            if len(ids) > self.n_ctx:
                raise ContextOverflowError(f"a text of {len(ids)} tokens does not fit in the context of {self.n_ctx} "
                                           "tokens")
            token_lists.append(ids)
        return token_lists

    def embedding_steps(self, token_lists: Sequence[Sequence[int]]) -> Generator[int, int, list[list[float]]]:
        """Embeds `token_lists` (from `embedding_ids`) slice by slice on this object's engine, so
        that a server can run other work between slices. A generator: prime it with next(), then
        send() each slice's size in tokens; it yields the tokens that slice evaluated and returns
        the vectors."""
        vectors = []
        budget = yield 0
        for ids in token_lists:
            self.engine.release(0)
            rows, start = [], 0
            while start < len(ids):
                rows.append(self.engine.extend(0, ids[start : start + max(1, budget)], which="hidden"))
                start += len(rows[-1])
                budget = yield len(rows[-1])
            vectors.append(torch.nn.functional.normalize(pool(torch.cat(rows), self.pooling), dim=0).tolist())
        return vectors

    @cached_property
    def pooling(self) -> int:
        """llama.cpp's pooling type from the file (1 mean, 2 first token, 3 last token; else mean)."""
        return int(open_gguf(self.path).get(f"{self.config.architecture}.pooling_type", MEAN_POOLING))


MEAN_POOLING, CLS_POOLING, LAST_POOLING = 1, 2, 3


def _one_of(name: str, value, alias: str, alias_value):
    """A keyword or its llama-cpp-python alias, not both."""
    if value is not None and alias_value is not None:
        raise PowerInferError(f"give {name} or {alias}, not both")
    return alias_value if value is None else value


def pool(hidden: torch.Tensor, pooling: int) -> torch.Tensor:
    """One vector from a text's hidden states [n_tokens, n_embd]."""
    if pooling == CLS_POOLING:
        return hidden[0]
    if pooling == LAST_POOLING:
        return hidden[-1]
    return hidden.mean(dim=0)
