"""The power-law picture of PowerInfer's paper: how skewed neuron firing is, per layer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from powerinfer.errors import PowerInferError
from powerinfer.outputs import atomic_file
from powerinfer.sparse.profiler import ActivationProfile


def coverage_share(counts: torch.Tensor, share: float = 0.8) -> float:
    """The fraction of neurons (most frequent first) that accounts for `share` of all firings."""
    ordered = torch.sort(counts.double(), descending=True).values
    total = ordered.sum()
    if total <= 0:
        return 0.0
    needed = int(torch.searchsorted(torch.cumsum(ordered, 0), share * total)) + 1
    return needed / len(ordered)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PowerInferError("plotting needs matplotlib: pip install 'powerinfer[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def image_format(output: str | os.PathLike[str]) -> str:
    """The image format an output name asks for (its extension), if matplotlib can write it."""
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    supported = FigureCanvasBase.get_supported_filetypes()
    extension = Path(output).suffix.lower().lstrip(".")
    if extension not in supported:
        raise PowerInferError(f"{output}: unknown image type {Path(output).suffix or '(no extension)'!r} "
                              f"(supported: {', '.join(sorted(supported))})")
    return extension


def plot_profile(profile: ActivationProfile, output: str | Path, title: str = "", replace: bool = True) -> list[float]:
    """Draw sorted firing frequency per layer (log scale) and the share of neurons covering 80 % of
    firings into the image `output` (atomically; over an existing file only when `replace`);
    returns those shares."""
    image_type = image_format(output)
    plt = _pyplot()

    shares = [coverage_share(c) for c in profile.counts]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    colours = plt.cm.viridis(torch.linspace(0, 1, len(profile.counts)).numpy())
    for i, (counts, colour) in enumerate(zip(profile.counts, colours)):
        frequency = torch.sort(counts.double(), descending=True).values / max(profile.tokens, 1)
        left.plot(torch.linspace(0, 100, len(frequency)).numpy(), frequency.clamp_min(1e-7).numpy(),
                  color=colour, lw=1, label=f"layer {i}" if i in (0, len(profile.counts) - 1) else None)
    left.set_yscale("log")
    left.set_xlabel("neurons, most frequent first (%)")
    left.set_ylabel("firing frequency (fraction of tokens)")
    left.set_title("sorted neuron firing frequency")
    left.legend()
    right.bar(range(len(shares)), [100 * s for s in shares], color=colours)
    right.set_xlabel("layer")
    right.set_ylabel("% of neurons covering 80 % of firings")
    right.set_title(f"mean {100 * sum(shares) / len(shares):.0f} % (PowerInfer reports 26 % for OPT-30B)")
    fig.suptitle(title or f"{profile.activation} activations, {profile.tokens} tokens")
    fig.tight_layout()
    with atomic_file(output, replace) as tmp:
        fig.savefig(tmp, dpi=110, format=image_type)
    plt.close(fig)
    return shares
