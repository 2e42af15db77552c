"""How a sparsified GGUF (`powerinfer sparsify`) stores its input-sparse linears.

A linear whose input channels are skipped per token is stored by columns: `blk.N.<part>_t.weight`
holds the transpose of `blk.N.<part>.weight`, one row per input channel in a GGML block type, in
its place (one copy of each weight). A skipped channel's weights are then one contiguous stretch
that is never read. PowerInfer's own files name their per-neuron down projection the same way
(`ffn_down_t`): rows there are the down projection's input channels too.

The site the linear reads (powerinfer.sparse.sites) has its thresholds in `blk.N.<kind>.thresholds`
(float32, one per input channel): channel i is read when |x_i| > threshold_i. A site whose
skipping would not pay stays stored by rows and runs dense.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from powerinfer.gguf.reader import GGUFFile, GGUFTensor
from powerinfer.ops.linear import BiasedLinear, Linear, build_linear, float_vector
from powerinfer.options import FFNOptions
from powerinfer.sparse.columns import column_linear

COLUMNS_SUFFIX = "_t"
THRESHOLDS_SUFFIX = ".thresholds"
TARGET_KEY = "powerinfer.input_sparsity.target"  # the model-wide sparsity the thresholds were chosen for

# The tensors of a block each site feeds (llama.cpp's names), by site kind.
SITE_TENSORS: dict[str, tuple[str, ...]] = {
    "attn_in": ("attn_q", "attn_k", "attn_v", "attn_qkv"),
    "attn_out": ("attn_output",),
    "ffn_in": ("ffn_gate", "ffn_up"),
    "ffn_down": ("ffn_down",),
}


def columns_name(weight_name: str) -> str:
    """`blk.3.attn_q.weight` -> `blk.3.attn_q_t.weight`: where its transpose is stored."""
    return weight_name.removesuffix(".weight") + COLUMNS_SUFFIX + ".weight"


def _site_of(weight_name: str) -> str:
    """The site (`blk.3.attn_in`) whose input feeds tensor `blk.3.attn_q.weight`."""
    block, part = weight_name.rsplit(".", 2)[:2]
    kind = next((k for k, parts in SITE_TENSORS.items() if part in parts), None)
    if kind is None:
        raise ValueError(f"{weight_name} reads no input-sparse site")
    return f"{block}.{kind}"


def thresholds_name(weight_name: str) -> str:
    """The thresholds tensor of the site that `weight_name` reads."""
    return _site_of(weight_name) + THRESHOLDS_SUFFIX


def is_sparsified(gguf: GGUFFile) -> bool:
    """Whether the file holds input-sparse linears (a `sparsify` output)."""
    return gguf.get(TARGET_KEY) is not None


def stored_by_columns(gguf: GGUFFile, weight_names: Sequence[str]) -> list[GGUFTensor] | None:
    """The column tensors of a linear made of `weight_names`, or None where the file stores it by
    rows. The parts of one linear are stored alike (sparsify writes a site whole)."""
    if not is_sparsified(gguf):
        return None
    stored = [columns_name(n) in gguf.tensors for n in weight_names]
    if not any(stored):
        return None
    if not all(stored):
        raise ValueError(f"{gguf.path}: {', '.join(weight_names)} are stored partly by columns")
    return [gguf.tensor(columns_name(n)) for n in weight_names]


def site_thresholds(gguf: GGUFFile, weight_name: str, sparsity: bool) -> torch.Tensor:
    """The thresholds of the site `weight_name` reads; zeros (every non-zero channel: the dense
    product) where `sparsity` is off."""
    thresholds = float_vector(gguf.tensor(thresholds_name(weight_name)))
    return thresholds if sparsity else torch.zeros_like(thresholds)


def projection_builder(gguf: GGUFFile, options: FFNOptions) -> Callable[..., Linear]:
    """`linear(*weight_names)`: one linear layer from weight tensors that share their input, plus
    their biases (`<name>.bias`) when the file has them (a part without one gets zeros). A file from
    `sparsify` may store the layer by columns: it then skips its input's small channels (none with
    sparsity "off")."""

    def linear(*names: str) -> Linear:
        columns = stored_by_columns(gguf, names)
        if columns is not None:
            layer = column_linear(columns, site_thresholds(gguf, names[0], options.sparsity != "off"))
            widths = [t.shape[1] for t in columns]
        else:
            layer = build_linear([gguf.tensor(n) for n in names], options.float32, release_pages=gguf.release_pages)
            widths = [gguf.tensor(n).shape[0] for n in names]
        biases = [gguf.tensors.get(n.removesuffix(".weight") + ".bias") for n in names]
        if all(b is None for b in biases):
            return layer
        return BiasedLinear(layer, torch.cat([torch.zeros(w) if b is None else float_vector(b) for w, b in zip(widths, biases)]))

    return linear
