"""Quantization mixes: which GGUF type each tensor of a quantized file gets.

The K-quant mixes re-state llama.cpp's rules in our words: `llama_tensor_get_type_impl` and
`tensor_type_fallback` in src/llama-quant.cpp (github ggml-org/llama.cpp, the version vendored by
llama-cpp-python 0.3.36). In short:

- `output.weight` (and `token_embd.weight` when the model ties it to the output) gets Q6_K; Q8_0
  for Falcon, for a Q8_0 base, or when its rows are not whole 256-value super-blocks.
- Q4_K_M / Q5_K_M give Q6_K to `attn_v` (also the fused `attn_qkv`) and `ffn_down` in the layers
  that "use more bits": the first and last eighth, and every third layer in between. Falcon's
  Q4_K_M `ffn_down` is graded instead (Q6_K in the first sixteenth, Q5_K in those layers, else Q4_K).
- Q4_K_S gives Q5_K to `attn_v` in the first 4 layers and to `ffn_down` in the first eighth.
- Eight-expert models (Mixtral) keep `attn_v`/`attn_k` in Q8_0 and, in Q4_K_S/M, `attn_output`
  in Q5_K; a 70B llama's `attn_v` (8 query heads per KV head) is at least Q5_K.
- A row width that is not a multiple of the type's block falls back: Q4_K -> Q5_0, Q5_K -> Q5_1,
  Q6_K -> Q8_0 (32-value blocks), and F16 when not even that fits.

`ffn_down_t` (PowerInfer's per-neuron copy of `ffn_down`) follows the `ffn_down` rule, as
llama.cpp's substring match would have it. The predictors (`fc1`/`fc2`) keep their type, except
in the PowerInfer preset, which re-states PowerInfer's own quantize (llama.cpp of late 2023 in
github SJTU-IPADS/PowerInfer, llama.cpp `get_k_quant_type`): Q4_0 everywhere, `output.weight` as
Q6_K, predictors Q4_0.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from powerinfer.convert.encode import storable
from powerinfer.errors import PowerInferError

T = GGMLQuantizationType
F = LlamaFileType
_LAYER = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelFacts:
    """What the rules look at besides a tensor's name and row width."""

    architecture: str
    n_layers: int
    tied_embeddings: bool  # no output.weight: token_embd is also the output matrix
    n_expert: int = 1
    llama_70b: bool = False  # llama.cpp's 70B rule: 80 layers with grouped KV heads


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's layers that get a bigger type in the _M mixes: the first and last eighth, and
    every third layer in between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _is_output(name: str, facts: ModelFacts) -> bool:
    return name == "output.weight" or (facts.tied_embeddings and name == "token_embd.weight")


def _output_type(base: T, width: int, facts: ModelFacts) -> T:
    if facts.architecture == "falcon" or width % GGML_QUANT_SIZES[base][0] or base == T.Q8_0:
        return T.Q8_0
    return T.Q6_K


def _layer(name: str) -> int:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else 0


def _k_mix_type(mix: str, base: T, name: str, facts: ModelFacts) -> T:
    """llama.cpp's choice for a matrix other than the output in K-quant mix `mix`."""
    layer, n_layers, falcon = _layer(name), facts.n_layers, facts.architecture == "falcon"
    eight_experts = facts.n_expert == 8
    if any(part in name for part in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")):
        chosen = base
        if mix in ("Q4_K_M", "Q5_K_M") and more_bits(layer, n_layers):
            chosen = T.Q6_K
        elif mix == "Q4_K_S" and layer < 4:
            chosen = T.Q5_K
        if facts.llama_70b and chosen == T.Q4_K:
            chosen = T.Q5_K
        return T.Q8_0 if eight_experts else chosen
    if "attn_k.weight" in name:
        return T.Q8_0 if eight_experts else base
    if "ffn_down" in name:
        if mix == "Q4_K_M" and falcon:
            return T.Q6_K if layer < n_layers // 16 else T.Q5_K if more_bits(layer, n_layers) else T.Q4_K
        if mix in ("Q4_K_M", "Q5_K_M") and more_bits(layer, n_layers):
            return T.Q6_K
        if mix == "Q4_K_S" and not falcon and layer < n_layers // 8:
            return T.Q5_K
        return base
    if "attn_output.weight" in name and eight_experts and not falcon and mix in ("Q4_K_S", "Q4_K_M"):
        return T.Q5_K
    return base


_PREDICTOR = re.compile(r"blk\.\d+\.fc[12]\.weight")
Rule = Callable[["Mix", str, ModelFacts], "T | None"]


def _uniform(mix: Mix, name: str, facts: ModelFacts) -> T | None:
    return None if _PREDICTOR.fullmatch(name) else mix.base


def _k_mix(mix: Mix, name: str, facts: ModelFacts) -> T | None:
    return None if _PREDICTOR.fullmatch(name) else _k_mix_type(mix.name, mix.base, name, facts)


def _everything(mix: Mix, name: str, facts: ModelFacts) -> T | None:
    return mix.base


@dataclass(frozen=True)
class Mix:
    """A file type of `powerinfer quantize`: its base type, llama.cpp's `general.file_type` and the
    rule giving each matrix's type (None: keep the source's)."""

    name: str
    base: T
    file_type: LlamaFileType
    rule: Rule
    output_rule: bool  # output.weight (and a tied token_embd) by llama.cpp's output rule

    def matrix_type(self, name: str, width: int, facts: ModelFacts) -> T | None:
        """The type for matrix `name` with rows of `width` values (None: keep the source's)."""
        if self.output_rule and _is_output(name, facts):
            return storable(_output_type(self.base, width, facts), width)
        chosen = self.rule(self, name, facts)
        return None if chosen is None else storable(chosen, width)


# Q4_0/Q4_1/Q8_0 and the pure K types put every matrix in one type (predictors kept); note that
# llama-quantize's "Q4_K" and "Q5_K" are aliases of its _M mixes, which we spell out.
MIXES = {mix.name: mix for mix in (
    Mix("Q4_0", T.Q4_0, F.MOSTLY_Q4_0, _uniform, False),
    Mix("Q4_1", T.Q4_1, F.MOSTLY_Q4_1, _uniform, False),
    Mix("Q8_0", T.Q8_0, F.MOSTLY_Q8_0, _uniform, False),
    Mix("Q4_K", T.Q4_K, F.MOSTLY_Q4_K_S, _uniform, False),
    Mix("Q5_K", T.Q5_K, F.MOSTLY_Q5_K_S, _uniform, False),
    Mix("Q6_K", T.Q6_K, F.MOSTLY_Q6_K, _uniform, False),
    Mix("Q4_K_S", T.Q4_K, F.MOSTLY_Q4_K_S, _k_mix, True),
    Mix("Q4_K_M", T.Q4_K, F.MOSTLY_Q4_K_M, _k_mix, True),
    Mix("Q5_K_S", T.Q5_K, F.MOSTLY_Q5_K_S, _k_mix, True),
    Mix("Q5_K_M", T.Q5_K, F.MOSTLY_Q5_K_M, _k_mix, True),
    Mix("POWERINFER_Q4_0", T.Q4_0, F.MOSTLY_Q4_0, _everything, True),  # predictors Q4_0 too
)}


def parse_mix(name: str) -> Mix:
    try:
        return MIXES[name.upper()]
    except KeyError:
        raise PowerInferError(f"unsupported quantization type {name!r} (choose from {', '.join(MIXES)})") from None
