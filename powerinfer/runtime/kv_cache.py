"""A preallocated key/value cache with one slot per concurrent sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from powerinfer.errors import PowerInferError
from powerinfer.ops.linear import CPU
from powerinfer.options import CacheType


@dataclass(frozen=True)
class SeqSpan:
    """Tokens of one sequence in a forward pass: they go to `slot` at positions start.."""

    slot: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


CACHE_TYPES: dict[str, torch.dtype] = {"f16": torch.float16, "f32": torch.float32}
# An accelerator's memory is the scarce resource, and its attention kernels compute in float16.
ACCELERATOR_CACHE_DTYPE = torch.float16


def cache_dtype(device: torch.device, cache_type: CacheType) -> torch.dtype:
    """What a layer's cache holds on `device`: `cache_type` in CPU memory (f16, llama.cpp's default,
    is half f32's memory: 2 GiB rather than 4 for a Llama 2 7B context of 4096), float16 on an accelerator."""
    return CACHE_TYPES[cache_type] if device.type == "cpu" else ACCELERATOR_CACHE_DTYPE


def memory_limit() -> int | None:
    """Bytes of physical memory plus swap on this machine (None where it cannot be read): a CPU
    cache larger than that can never be held, whatever is lazily allocated."""
    try:
        with open("/proc/meminfo") as file:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in file if line.split()[1:2]}
        return fields["MemTotal"] + fields.get("SwapTotal", 0)
    except (OSError, KeyError, ValueError):
        return None


def cache_bytes(n_layers: int, n_slots: int, n_kv_heads: int, n_ctx: int, head_dim: int, dtype: torch.dtype) -> int:
    """What a cache of these dimensions takes: keys and values of every layer."""
    return 2 * n_layers * n_slots * n_kv_heads * n_ctx * head_dim * dtype.itemsize


def check_cache_fits(n_bytes: int, n_slots: int, n_ctx: int) -> None:
    """Refuse, with the figure, a CPU cache this machine can never hold (before allocating it)."""
    limit = memory_limit()
    if limit is not None and n_bytes > limit:
        raise PowerInferError(f"a KV cache of {n_slots} slot(s) x {n_ctx} tokens needs {n_bytes / 2**30:.1f} GiB, "
                              f"more than this machine's {limit / 2**30:.1f} GiB of memory and swap "
                              "(lower -c or --parallel)")


class KVCache:
    """Keys and values per layer as [slots, kv_heads, n_ctx, head_dim], allocated once, each layer's
    on the device its attention runs on (`devices`: None puts all on the CPU), of `cache_type` on the CPU
    (the default is the engine's to choose)."""

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, n_ctx: int, head_dim: int,
                 devices: Sequence[torch.device] | None, cache_type: CacheType):
        shape = (n_slots, n_kv_heads, n_ctx, head_dim)
        devices = devices or [CPU] * n_layers
        on_cpu = [d for d in devices if d.type == "cpu"]
        check_cache_fits(cache_bytes(len(on_cpu), n_slots, n_kv_heads, n_ctx, head_dim, CACHE_TYPES[cache_type]),
                         n_slots, n_ctx)
        # Uninitialised: positions are always written before they are read, and pages never
        # written (the unused end of the context) then cost no resident memory.
        try:
            self.keys = [torch.empty(shape, dtype=cache_dtype(d, cache_type), device=d) for d in devices]
            self.values = [torch.empty(shape, dtype=cache_dtype(d, cache_type), device=d) for d in devices]
        except (RuntimeError, MemoryError) as error:  # the allocator's refusal (torch.OutOfMemoryError is one)
            n_bytes = sum(cache_bytes(1, n_slots, n_kv_heads, n_ctx, head_dim, cache_dtype(d, cache_type))
                          for d in devices)
            raise PowerInferError(f"cannot allocate a KV cache of {n_slots} slot(s) x {n_ctx} tokens "
                                  f"({n_bytes / 2**30:.1f} GiB; lower -c or --parallel): "
                                  f"{str(error).splitlines()[0]}") from None
        self.n_slots, self.n_ctx = n_slots, n_ctx
        # Per layer and slot, [1, kv_heads, n_ctx, head_dim] views made once: slicing them is the
        # whole per-step cost of reading the cache.
        self._slot_keys = [[k[s : s + 1] for s in range(n_slots)] for k in self.keys]
        self._slot_values = [[v[s : s + 1] for s in range(n_slots)] for v in self.values]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def slot_views(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer and slot: [1, kv_heads, n_ctx, head_dim] each."""
        return self._slot_keys[layer][slot], self._slot_values[layer][slot]

    def store(self, layer: int, span: SeqSpan, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys/values [1, kv_heads, length, head_dim] of `span`; return the slot's
        [1, kv_heads, end, head_dim] views."""
        k_cache, v_cache = self._slot_keys[layer][span.slot], self._slot_values[layer][span.slot]
        k_cache[:, :, span.start : span.end] = keys
        v_cache[:, :, span.start : span.end] = values
        return k_cache[:, :, : span.end], v_cache[:, :, : span.end]

    def copy_slot(self, source: int, target: int, length: int) -> None:
        """Give slot `target` the first `length` positions of slot `source` (several sequences
        continuing one evaluated prompt)."""
        for layer in range(len(self.keys)):
            for cache in (self._slot_keys[layer], self._slot_values[layer]):
                cache[target][:, :, :length].copy_(cache[source][:, :, :length])
