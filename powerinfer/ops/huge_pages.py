"""Weights in memory marked for transparent huge pages: the packed rows of the dense kernels, the
channel runs of input-sparse linears, the neuron records.

The dense 7B-width Q4_0 file of benchmarks/sparse_7b.py decoded at a median 39.6 tok/s on huge
pages against 35.3 on 4 KiB pages (AMD EPYC, 2 threads, seven processes each, alternated); reading
scattered records (an 11008 -> 4096 linear's channel runs at 50 %) gained 30 %."""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20  # a transparent huge page of x86-64


def hugepage_buffer(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A zeroed uint8 tensor of `nbytes` in anonymous memory, its whole 2 MiB pages inside the mapping
    marked for transparent huge pages where the kernel allows. The tensor starts on a 2 MiB boundary
    and no page past its end is touched, so it costs its own bytes. Keep the mapping with the tensor."""
    size = nbytes + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE, start, whole)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start), region
