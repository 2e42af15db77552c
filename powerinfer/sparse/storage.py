"""How a sparsified GGUF (`powerinfer sparsify`) stores its input-sparse linears.

The weights stay as the source stores them, by rows: the gguf package and `--sparsity off` read a
plain model. A site (powerinfer.sparse.sites) whose skipping pays has its thresholds in
`blk.N.<kind>.thresholds`, or `output.thresholds` for the head (float32, one per input channel: channel i is read when |x_i| >
threshold_i); at load its linears are regrouped into channel runs (columns.py), in which a skipped
channel's weights are never read. A site without thresholds runs dense.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from powerinfer.errors import ModelFileError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.ops.linear import BiasedLinear, Linear, build_linear, float_vector
from powerinfer.options import FFNOptions
from powerinfer.sparse.columns import column_linear, runs_take

OLD_COLUMNS_SUFFIX = "_t.weight"  # the transposed linears of an earlier sparsify
THRESHOLDS_SUFFIX = ".thresholds"
TARGET_KEY = "powerinfer.input_sparsity.target"  # the model-wide sparsity the thresholds were chosen for

# The tensors of a block each site feeds (llama.cpp's names), by site kind.
SITE_TENSORS: dict[str, tuple[str, ...]] = {
    "attn_in": ("attn_q", "attn_k", "attn_v", "attn_qkv"),
    "attn_out": ("attn_output",),
    "ffn_in": ("ffn_gate", "ffn_up"),
    "ffn_down": ("ffn_down",),
}


HEAD = "output"  # the output head's site (sites.py), and its thresholds' name in a file
# The tensors the output head reads (its own, or the token embedding it shares).
HEAD_TENSORS = ("output.weight", "token_embd.weight")


def _site_of(weight_name: str) -> str | None:
    """The site (`blk.3.attn_in`, or HEAD) whose input feeds tensor `blk.3.attn_q.weight` (or the
    head's); None for a tensor outside the sites."""
    if weight_name in HEAD_TENSORS:
        return HEAD
    if weight_name.count(".") < 2:
        return None
    block, part = weight_name.rsplit(".", 2)[:2]
    kind = next((k for k, parts in SITE_TENSORS.items() if part in parts), None)
    return None if kind is None else f"{block}.{kind}"


def is_sparsified(gguf: GGUFFile) -> bool:
    """Whether the file holds input-sparse linears (a `sparsify` output)."""
    return gguf.get(TARGET_KEY) is not None


def sparse_sites(gguf: GGUFFile) -> set[str]:
    """The names of the sites that hold thresholds in a `sparsify` output (the ones that skip)."""
    return {n.removesuffix(THRESHOLDS_SUFFIX) for n in gguf.tensors if n.endswith(THRESHOLDS_SUFFIX)}


def sparse_site(gguf: GGUFFile, weight_names: Sequence[str], sparsity: bool) -> torch.Tensor | None:
    """The thresholds of the site the linear of `weight_names` reads, or None where it runs dense (not
    a sparsified file, a site without thresholds, or `sparsity` off)."""
    site = _site_of(weight_names[0])
    if not (sparsity and site is not None and is_sparsified(gguf)):
        return None
    name = site + THRESHOLDS_SUFFIX
    return float_vector(gguf.tensor(name)) if name in gguf.tensors else None


def check_sparsified(gguf: GGUFFile) -> None:
    """Refuses a file that an earlier `sparsify` wrote with transposed linears (no rows to run)."""
    if is_sparsified(gguf) and any(n.endswith(OLD_COLUMNS_SUFFIX) and n.startswith("blk.") for n in gguf.tensors):
        raise ModelFileError(f"{gguf.path}: written by an earlier powerinfer sparsify (transposed linears); "
                             "sparsify its dense source again")


def projection_builder(gguf: GGUFFile, options: FFNOptions) -> Callable[..., Linear]:
    """`linear(*weight_names)`: one linear layer from weight tensors that share their input, plus
    their biases (`<name>.bias`) when the file has them (a part without one gets zeros). In a file
    from `sparsify`, a layer whose site has thresholds skips its input's small channels (none with
    sparsity "off")."""
    check_sparsified(gguf)

    def linear(*names: str) -> Linear:
        tensors = [gguf.tensor(n) for n in names]
        thresholds = sparse_site(gguf, names, options.sparsity != "off")
        if thresholds is not None and not options.float32 and runs_take([t.ggml_type for t in tensors]):
            layer = column_linear(tensors, thresholds, gguf.release_pages)
        else:
            layer = build_linear(tensors, options.float32, release_pages=gguf.release_pages)
        widths = [t.shape[0] for t in tensors]
        biases = [gguf.tensors.get(n.removesuffix(".weight") + ".bias") for n in names]
        if all(b is None for b in biases):
            return layer
        return BiasedLinear(layer, torch.cat([torch.zeros(w) if b is None else float_vector(b) for w, b in zip(widths, biases)]))

    return linear
