"""Applying a placement to a finished model.

Models are built on the CPU knowing nothing of accelerators (as gpt-fast's `replace_linear_int4` or
mlx-lm's `nn.quantize` transform a finished model, this module transforms ours): blocks whose
dense parts go to the accelerator are moved there, layers with hot neurons get a `HybridFFN`, and
layers offloaded whole (llama.cpp's `-ngl`) get their FFN dense on the accelerator.
"""

from __future__ import annotations

import torch

from powerinfer.models.base import DecoderLM
from powerinfer.placement.spec import Placement
from powerinfer.sparse.hybrid import HybridFFN


def apply_placement(model: DecoderLM, placement: Placement) -> None:
    """Move what `placement` names to its device, in place. Its plan gives hot neurons per FFN unit:
    a layer's FFN, or an expert of a mixture (whose router stays on the CPU: there its experts
    take their input, whatever device holds the block)."""
    device = placement.device
    for i, block in enumerate(model.blocks):
        if placement.offloads(i):
            block.to(device)
        if i in placement.whole:
            block.ffn = block.ffn.dense().to(device)
    for unit in model.ffn_units():
        offloaded = placement.offloads(unit.layer) and unit.expert is None
        if unit.layer not in placement.whole and (placement.has_hot(unit.index) or offloaded):
            hot = torch.from_numpy(placement.plan.hot[unit.index]).long()
            unit.replace(HybridFFN(unit.ffn.sparse(), hot, device, offloaded=offloaded))
    if placement.dense.output:
        model.output_to(device)
