"""The input-sparse sites of a model: four per block, and the output head; and a way to run a model
with their inputs masked.

A site is the input of one (fused) linear: per token, the input channels whose magnitude is at or
under the site's per-channel threshold are skipped (TEAL). The head is a site too: its input is the
final norm's output, and its channel runs are the longest of the model (a run holds a weight per
vocabulary entry), so it is where skipping saves the most memory traffic per channel. This module
names the sites (one place), finds their linears in a loaded model, and wraps those linears so that
the torch path computes exactly what an input-sparse kernel computes: the dense product of the
masked input ("masked dense").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from powerinfer.errors import UnsupportedModelError
from powerinfer.models.layers import Block
from powerinfer.ops.linear import Linear
from powerinfer.sparse.ffn import DenseFFN
from powerinfer.sparse.select import selected
from powerinfer.sparse.storage import HEAD  # the head site's name, kind, and the model's attribute

# kind -> (the block's part, the part's attribute holding the linear whose input the site is)
SITE_PARTS: dict[str, tuple[str, str]] = {
    "attn_in": ("attention", "qkv"),  # fused q/k/v
    "attn_out": ("attention", "output"),  # o
    "ffn_in": ("ffn", "up"),  # fused gate/up
    "ffn_down": ("ffn", "down"),
}
SITE_KINDS = tuple(SITE_PARTS)


def site_name(layer: int, kind: str) -> str:
    """The stable name of a site, e.g. `blk.3.ffn_down`."""
    return f"blk.{layer}.{kind}"


@dataclass(frozen=True, eq=False)
class Site:
    """Input `kind` (one of SITE_KINDS) of block `layer`, or the output head (layer None, kind HEAD);
    `owner`: the block, or the model for the head."""

    layer: int | None
    kind: str
    owner: object

    @property
    def name(self) -> str:
        return HEAD if self.layer is None else site_name(self.layer, self.kind)

    def _holder(self) -> tuple[object, str]:
        """The object and attribute that hold the site's linear."""
        if self.layer is None:
            return self.owner, HEAD
        part, attribute = SITE_PARTS[self.kind]
        return getattr(self.owner, part), attribute

    @property
    def linear(self) -> Linear:
        holder, attribute = self._holder()
        return getattr(holder, attribute)

    def put(self, linear: Linear) -> None:
        """Make `linear` the site's linear."""
        holder, attribute = self._holder()
        setattr(holder, attribute, linear)
        if self.layer is not None:
            self.owner.rebuild_step()  # a native step held the old linear (and takes none without a native form)

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def weight_count(self) -> int:
        """Weights of the site's linear: what skipping all its channels saves, in weights."""
        return self.linear.in_features * self.linear.out_features


def model_sites(model) -> list[Site]:
    """Every site of every block of `model`, in layer order, then SITE_KINDS order; then the head."""
    sites = []
    for layer, block in enumerate(model.blocks):
        if not isinstance(block, Block) or not isinstance(block.ffn, DenseFFN):
            raise UnsupportedModelError(f"layer {layer}: input sparsity needs dense attention and FFN blocks "
                                        f"(found {type(block.ffn).__name__}); a ReLU model uses the predictor flow")
        sites.extend(Site(layer, kind, block) for kind in SITE_KINDS)
    return [*sites, Site(None, HEAD, model)]


class TappedLinear(Linear):
    """A linear whose input goes through `tap` first (a mask, or an observer that returns it)."""

    def __init__(self, linear: Linear, tap: Callable[[torch.Tensor], torch.Tensor]):
        self.linear, self.tap = linear, tap
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.tap(x))

    @property
    def nbytes(self) -> int:
        return self.linear.nbytes


@contextmanager
def tapped(sites: Sequence[Site], taps: Mapping[str, Callable[[torch.Tensor], torch.Tensor]]) -> Iterator[None]:
    """Within the block, the sites named in `taps` run their input through their tap, on the torch
    path (a tapped linear has no native form, so its block has no native step until the originals
    are put back)."""
    chosen = [s for s in sites if s.name in taps]
    originals = [s.linear for s in chosen]
    try:
        for site in chosen:
            site.put(TappedLinear(site.linear, taps[site.name]))
        yield
    finally:
        for site, linear in zip(chosen, originals):
            site.put(linear)


def masked(sites: Sequence[Site], thresholds: Mapping[str, torch.Tensor]) -> AbstractContextManager[None]:
    """`tapped` with each named site's input masked by its per-channel thresholds (float32 [in])."""
    return tapped(sites, {name: _mask(t) for name, t in thresholds.items()})


def _mask(thresholds: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: selected(x, thresholds.to(x.device))
