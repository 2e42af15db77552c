"""A model's placement: from its GGUF file, a VRAM budget and activation statistics, or from its
stored GPU index.

Statistics come from `activations` (a profile directory: ours, or PowerInfer's activation/), else
from `activation/` next to the model (PowerInfer's layout), else every neuron counts as equally
likely (the solver then spreads the budget evenly; a note says so).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from powerinfer.config import ModelConfig
from powerinfer.errors import PowerInferError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.moe import ffn_unit_tensors
from powerinfer.placement.costs import DenseParts, GiB, ModelShape, Speeds, dense_ffn_bytes, dense_parts, model_shape
from powerinfer.placement.gpu_index import index_path, load_gpu_index, write_gpu_index
from powerinfer.placement.solver import DEFAULT_GROUP_SIZE, Plan, plan_from_counts
from powerinfer.placement.spec import DensePlacement, Placement, no_hot_neurons

IndexMode = Literal["reuse", "reset", "memory"]  # memory: neither read nor write the index file
GPUIndexMode = Literal["reuse", "reset", "disable"]  # what users ask for (disable: no neuron split)
Warn = Callable[[str], None]


def stderr_note(message: str) -> None:
    print(f"powerinfer: {message}", file=sys.stderr)


@dataclass(frozen=True)
class Statistics:
    counts: list[torch.Tensor]
    tokens: int
    source: str


def load_statistics(model_path: Path, shape: ModelShape, activations: str | os.PathLike[str] | None,
                    note: Warn) -> Statistics:
    from powerinfer.sparse.profiler import ActivationProfile

    folder = Path(activations) if activations is not None else model_path.parent / "activation"
    if activations is not None or folder.is_dir():
        if not folder.is_dir():
            raise PowerInferError(f"{folder}: activation statistics directory not found")
        profile = ActivationProfile.load(folder)
        return Statistics(profile.counts, profile.tokens, str(folder))
    note("no activation statistics (--activations DIR or activation/ next to the model): "
         "every neuron is taken as equally likely to fire")
    return Statistics([torch.ones(n) for n in shape.n_ff], 1, "uniform")


def place_dense(parts: DenseParts, vram_budget: int) -> DensePlacement:
    """Dense parts first, as PowerInfer does: they are read for every token, so each byte of them on
    the accelerator saves at least as much CPU time as a byte of the hottest neuron. The output head,
    then whole blocks from the last one down (x then crosses to the accelerator once per token),
    while they fit."""
    used, output = 0, parts.output <= vram_budget
    used += parts.output if output else 0
    layers = []
    for i in reversed(range(len(parts.layers))):
        if used + parts.layers[i] > vram_budget:
            break
        used += parts.layers[i]
        layers.append(i)
    return DensePlacement(frozenset(layers), output, used)


def neuron_budget(gguf: GGUFFile, config: ModelConfig, n_ctx: int, n_slots: int, vram_budget: int) -> int:
    """Bytes left for FFN neurons once the dense parts that fit are placed."""
    return max(0, vram_budget - place_dense(dense_parts(gguf, config, n_ctx, n_slots), vram_budget).bytes_used)


def plan_from_index(hot: tuple[np.ndarray, ...], capacity: int, shape: ModelShape,
                    statistics: Statistics | None = None) -> Plan:
    """A plan read back from a GPU index (with its served share when statistics are at hand)."""
    used = sum(len(h) * b for h, b in zip(hot, shape.neuron_bytes))
    share = None
    if statistics is not None:
        total = sum(float(c.sum()) for c in statistics.counts)
        served = sum(float(np.asarray(c, dtype=np.float64)[h].sum()) for c, h in zip(statistics.counts, hot))
        share = served / total if total > 0 else 0.0
    return Plan(hot, shape.n_ff, used, capacity, share, None, None, None)


def plan_for_model(gguf: GGUFFile, config: ModelConfig, model_path: str | os.PathLike[str], n_ctx: int,
                   vram_budget: int, *, n_slots: int = 1, index: IndexMode = "reuse", activations: str | os.PathLike[str] | None = None,
                   speeds: Speeds = Speeds(), group_size: int = DEFAULT_GROUP_SIZE, note: Warn = stderr_note,
                   accelerator: str = "cpu") -> Plan:
    """The neuron placement to run with on an accelerator of type `accelerator`: the stored index
    while the budget covers its capacity (mode "reuse"), else a fresh solve, written next to the
    model unless mode is "memory"."""
    model_path = Path(model_path)
    shape = model_shape(gguf, config, accelerator)
    capacity = neuron_budget(gguf, config, n_ctx, n_slots, vram_budget)
    path = index_path(model_path)
    if index == "reuse":
        stored = load_gpu_index(path, shape.n_ff, lambda m: note(f"warning: {m}"))
        if stored is not None:
            plan = plan_from_index(*stored, shape)
            if plan.bytes_used > plan.capacity:
                note(f"warning: ignoring stale GPU index ({path}: its neurons need {plan.bytes_used} bytes, "
                     f"more than the {plan.capacity} it was made for); rebuilding it")
            elif capacity >= plan.capacity:
                return plan
    statistics = load_statistics(model_path, shape, activations, note)
    plan = plan_from_counts(statistics.counts, statistics.tokens, shape, capacity, speeds, group_size)
    if index != "memory":
        try:
            write_gpu_index(path, plan)
        except (OSError, PowerInferError) as error:
            note(f"warning: could not write the GPU index {path} ({error}); using the plan for this run only")
    return plan


def plan_table(plan: Plan, statistics: Statistics, shape: ModelShape) -> str:
    """One line per layer: neurons on the accelerator, their bytes and the share of the layer's
    activations they serve."""
    lines = ["layer  on accel  of n_ff  MiB     served"]
    for i, (hot, n_ff, b) in enumerate(zip(plan.hot, plan.n_ff, shape.neuron_bytes)):
        counts = np.asarray(statistics.counts[i], dtype=np.float64)
        total = counts.sum()
        served = f"{100 * counts[hot].sum() / total:5.1f}%" if total > 0 else "    -"
        lines.append(f"{i:5d}  {len(hot):8d}  {100 * len(hot) / n_ff:5.1f}%  {len(hot) * b / (1 << 20):7.1f}  {served}")
    return "\n".join(lines)



def accelerator_device(accelerator: str | torch.device | None) -> torch.device | None:
    """The device hot neurons go to: as asked, else CUDA when present, else None (all on the CPU)."""
    if accelerator is None:
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        device = torch.device(accelerator)
    except RuntimeError:
        raise PowerInferError(f"unknown accelerator device {accelerator!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PowerInferError(f"accelerator {accelerator!r} asked for, but torch sees no CUDA device")
    return device


def neuron_placement(gguf: GGUFFile, config: ModelConfig, model_path: str | os.PathLike[str], n_ctx: int,
                     n_slots: int, vram_budget: float, device: torch.device, *, gpu_index: GPUIndexMode = "reuse",
                     activations: str | os.PathLike[str] | None = None, note: Warn = stderr_note) -> Placement:
    """PowerInfer's placement for a VRAM budget in GiB: dense parts first, then the hottest neurons
    (with the GPU index disabled: dense parts only, as in PowerInfer). `n_slots` KV-cache slots
    are budgeted for."""
    if vram_budget < 0:
        raise PowerInferError(f"VRAM budget must be >= 0 GiB, got {vram_budget}")
    if gpu_index not in ("reuse", "reset", "disable"):
        raise PowerInferError(f"unknown GPU index mode {gpu_index!r} (expected 'reuse', 'reset' or 'disable')")
    budget = int(vram_budget * GiB)
    dense = place_dense(dense_parts(gguf, config, n_ctx, n_slots), budget)
    if gpu_index == "disable":
        note("GPU index disabled: FFN neurons run on the CPU")
        plan = no_hot_neurons(model_shape(gguf, config).n_ff)
    else:
        plan = plan_for_model(gguf, config, model_path, n_ctx, budget, n_slots=n_slots, index=gpu_index,
                              activations=activations, note=note, accelerator=device.type)
    return Placement(device, plan, dense)


def layer_offload(gguf: GGUFFile, config: ModelConfig, n_ctx: int, n_slots: int, n_gpu_layers: int,
                  device: torch.device) -> Placement:
    """llama.cpp's `-ngl N`: the last N blocks go to the accelerator whole (FFNs dense), and the output
    head too when N exceeds the block count."""
    if n_gpu_layers < 0:
        raise PowerInferError(f"n_gpu_layers must be >= 0, got {n_gpu_layers}")
    parts = dense_parts(gguf, config, n_ctx, n_slots)
    layers = frozenset(range(max(0, config.n_layers - n_gpu_layers), config.n_layers))
    output = n_gpu_layers > config.n_layers
    ffns = sum(dense_ffn_bytes(u) for u in ffn_unit_tensors(gguf, config) if u.layer in layers)
    used = sum(parts.layers[i] for i in layers) + ffns + (parts.output if output else 0)
    return Placement(device, no_hot_neurons(model_shape(gguf, config).n_ff), DensePlacement(layers, output, used),
                     whole=layers)


def choose_placement(gguf: GGUFFile, config: ModelConfig, model_path: str | os.PathLike[str], n_ctx: int,
                     n_slots: int, *, vram_budget: float | None = None, n_gpu_layers: int | None = None,
                     gpu_index: GPUIndexMode = "reuse", activations: str | os.PathLike[str] | None = None,
                     accelerator: str | torch.device | None = None, note: Warn = stderr_note) -> Placement | None:
    """The placement asked for: neurons by VRAM budget (PowerInfer) or whole layers (llama.cpp's
    -ngl); None, said in one line through `note`, when there is no accelerator."""
    if vram_budget is not None and n_gpu_layers is not None:
        raise PowerInferError("give either a VRAM budget or a number of GPU layers, not both")
    device = accelerator_device(accelerator)
    if device is None:
        note(f"no CUDA device: {'the VRAM budget' if vram_budget is not None else f'-ngl {n_gpu_layers}'} is ignored "
             "and everything runs on the CPU")
        return None
    if n_gpu_layers is not None:
        placement = layer_offload(gguf, config, n_ctx, n_slots, n_gpu_layers, device)
    else:
        placement = neuron_placement(gguf, config, model_path, n_ctx, n_slots, vram_budget, device,
                                     gpu_index=gpu_index, activations=activations, note=note)
    note(f"placement on {device}: {placement.summary(config.n_layers)}")
    return placement
