"""The tensors an architecture reads, with the shapes its config implies, checked before anything loads.

A crafted or broken file (a halved `attn_q`, an embedding with too few rows, a norm of width 0)
must fail at load with one line naming the tensor, not at the first token with a traceback.
Shapes are in torch order (rows first), as `GGUFTensor.shape` gives them; None means any size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from powerinfer.config import ModelConfig
from powerinfer.errors import ModelFileError
from powerinfer.gguf.reader import GGUFFile

Shape = tuple[int | None, ...]


@dataclass
class TensorTable:
    """Expected tensors: `shapes` by name, which of them are `required`, and groups of names of which
    exactly one must be present (`one_of`: e.g. ffn_down or PowerInfer's ffn_down_t)."""

    shapes: dict[str, Shape] = field(default_factory=dict)
    required: set[str] = field(default_factory=set)
    one_of: list[tuple[str, ...]] = field(default_factory=list)

    def add(self, name: str, shape: Shape, required: bool = True) -> None:
        self.shapes[name] = shape
        if required:
            self.required.add(name)

    def add_one_of(self, shapes: dict[str, Shape]) -> None:
        self.shapes.update(shapes)
        self.one_of.append(tuple(shapes))

    def check(self, gguf: GGUFFile) -> None:
        for name in sorted(self.required):
            if name not in gguf.tensors:
                raise ModelFileError(f"{gguf.path}: tensor {name} is missing")
        for names in self.one_of:
            present = [n for n in names if n in gguf.tensors]
            if len(present) != 1:
                raise ModelFileError(f"{gguf.path}: expected exactly one of {', '.join(names)}, found {len(present)}")
        for name, expected in self.shapes.items():
            tensor = gguf.tensors.get(name)
            if tensor is None:
                continue
            shape = tuple(tensor.shape)
            if len(shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, shape)) \
                    or any(s <= 0 for s in shape):
                want = "x".join("*" if e is None else str(e) for e in expected)
                raise ModelFileError(f"{gguf.path}: tensor {name} has shape {'x'.join(map(str, shape))}, "
                                     f"expected {want} for this model's configuration")


def add_attention(table: TensorTable, prefix: str, config: ModelConfig, fused: bool = False) -> None:
    """Q, K, V (separate, or `fused` as attn_qkv) and the output projection, with optional biases."""
    d, q, kv = config.n_embd, config.q_dim, config.kv_dim
    parts = {"attn_qkv": q + 2 * kv} if fused else {"attn_q": q, "attn_k": kv, "attn_v": kv}
    for name, rows in parts.items():
        table.add(f"{prefix}{name}.weight", (rows, d))
        table.add(f"{prefix}{name}.bias", (rows,), required=False)
    table.add(f"{prefix}attn_output.weight", (d, q))
    table.add(f"{prefix}attn_output.bias", (d,), required=False)


def add_norm(table: TensorTable, name: str, config: ModelConfig, bias: bool = False, required: bool = True) -> None:
    table.add(f"{name}.weight", (config.n_embd,), required)
    if bias:
        table.add(f"{name}.bias", (config.n_embd,), required)


def add_ffn(table: TensorTable, prefix: str, config: ModelConfig, fused_gate_up: bool = False) -> None:
    """Gate (gated activations; with `fused_gate_up` its rows come first in ffn_up, as Phi-3 stores
    them), up and down (or PowerInfer's ffn_down_t, one row per neuron), their optional biases, and
    the optional predictor (fc1, fc2: any rank). A mixture of experts has its router and experts
    instead (`add_experts`)."""
    if config.n_expert:
        add_experts(table, prefix, config)
        return
    d, n_ff = config.n_embd, config.n_ff
    gated = config.activation.is_gated
    if gated and not fused_gate_up:
        table.add(f"{prefix}ffn_gate.weight", (n_ff, d))
    table.add(f"{prefix}ffn_up.weight", (2 * n_ff if gated and fused_gate_up else n_ff, d))
    table.add(f"{prefix}ffn_up.bias", (n_ff,), required=False)
    table.add_one_of({f"{prefix}ffn_down.weight": (d, n_ff), f"{prefix}ffn_down_t.weight": (n_ff, d)})
    table.add(f"{prefix}ffn_down.bias", (d,), required=False)
    table.add(f"{prefix}ffn_down_t.bias", (d,), required=False)
    table.add(f"{prefix}fc1.weight", (None, d), required=False)
    table.add(f"{prefix}fc2.weight", (n_ff, None), required=False)


def add_experts(table: TensorTable, prefix: str, config: ModelConfig) -> None:
    """A mixture of experts as llama.cpp stores it: the router ffn_gate_inp [n_expert, n_embd] and the
    experts' matrices stacked, ffn_{gate,up}_exps [n_expert, n_ff, n_embd] and ffn_down_exps
    [n_expert, n_embd, n_ff]; optional predictors per expert (fc1.E, fc2.E)."""
    d, n_ff, n = config.n_embd, config.n_ff, config.n_expert
    table.add(f"{prefix}ffn_gate_inp.weight", (n, d))
    if config.activation.is_gated:
        table.add(f"{prefix}ffn_gate_exps.weight", (n, n_ff, d))
    table.add(f"{prefix}ffn_up_exps.weight", (n, n_ff, d))
    table.add(f"{prefix}ffn_down_exps.weight", (n, d, n_ff))
    for e in range(n):
        table.add(f"{prefix}fc1.{e}.weight", (None, d), required=False)
        table.add(f"{prefix}fc2.{e}.weight", (n_ff, None), required=False)


def add_head_norms(table: TensorTable, prefix: str, config: ModelConfig) -> None:
    """attn_q_norm and attn_k_norm: RMSNorms over one head (Qwen3, Gemma 3)."""
    for name in ("attn_q_norm", "attn_k_norm"):
        table.add(f"{prefix}{name}.weight", (config.head_dim,))


def add_embedding_and_head(table: TensorTable, config: ModelConfig, norm_bias: bool = False) -> None:
    """Token embedding, final norm and output head (absent when tied to the embedding)."""
    table.add("token_embd.weight", (config.n_vocab, config.n_embd))
    add_norm(table, "output_norm", config, bias=norm_bias)
    table.add("output.weight", (config.n_vocab, config.n_embd), required=False)


def rms_decoder_tensors(config: ModelConfig, head_norms: bool = False, fused: bool = False,
                        post_norms: bool = False) -> TensorTable:
    """The llama family's tensors (RMSNorms before attention and FFN): with per-head Q and K norms
    (`head_norms`), fused attn_qkv and gate-up (`fused`, Phi-3), and norms after attention and FFN
    (`post_norms`, Gemma 3)."""
    table = TensorTable()
    add_embedding_and_head(table, config)
    table.add("rope_freqs.weight", (config.rope_dim // 2,), required=False)
    for name in ("rope_factors_long", "rope_factors_short"):
        table.add(f"{name}.weight", (config.rope_dim // 2,), required=False)
    for i in range(config.n_layers):
        prefix = f"blk.{i}."
        add_norm(table, f"{prefix}attn_norm", config)
        add_attention(table, prefix, config, fused=fused)
        if head_norms:
            add_head_norms(table, prefix, config)
        add_norm(table, f"{prefix}ffn_norm", config)
        if post_norms:
            add_norm(table, f"{prefix}post_attention_norm", config)
            add_norm(table, f"{prefix}post_ffw_norm", config)
        add_ffn(table, prefix, config, fused_gate_up=fused)
    return table
