"""Our C++ operators (powerinfer/ops/csrc), compiled when the package is installed (setup.py).

The compiled module only loads under the torch it was built against (torch's C++ ABI changes
between releases), so the build records that version beside it and `load()` checks it before
importing. When the module is missing or does not fit the running torch, `load()` prints one line
that says how to rebuild it and returns None; callers then use their plain-torch reference
implementations. Nothing is compiled at run time.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from powerinfer.config import FFNActivation

PACKAGE_DIR = Path(__file__).resolve().parent.parent
MODULE = "powerinfer._native"  # the extension setup.py builds
BUILD_INFO = "_native_build.json"  # written beside it: {"torch": version it was compiled against}
REBUILD = "reinstall powerinfer with the torch you run: pip install --no-build-isolation --force-reinstall --no-deps <powerinfer source or sdist>"


def _release(version: str) -> str:
    """A torch version without its local tag ('2.13.0+cpu' -> '2.13.0'): builds of one release
    for different accelerators share the CPU ABI."""
    return version.split("+")[0]


def _unavailable(reason: str) -> None:
    print(f"powerinfer: warning: native operators unavailable ({reason}), running plain torch, much slower; {REBUILD}",
          file=sys.stderr)


@cache
def load() -> ModuleType | None:
    """The compiled operators, or None (after one line on stderr) where they cannot be used, or
    where POWERINFER_NO_NATIVE is set (plain torch on purpose)."""
    return None if os.environ.get("POWERINFER_NO_NATIVE") else import_compiled()


def import_compiled() -> ModuleType | None:
    """`load()` without its cache: the compiled module if it was built for the running torch."""
    import torch

    info = PACKAGE_DIR / BUILD_INFO
    try:
        built_with = json.loads(info.read_text())["torch"]
    except (OSError, ValueError, KeyError):
        _unavailable(f"{info.name} not found: the package was installed without its compiled module")
        return None
    if _release(built_with) != _release(torch.__version__):
        _unavailable(f"built for torch {built_with}, running torch {torch.__version__}")
        return None
    try:
        return importlib.import_module(MODULE)
    except ImportError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        _unavailable(f"{MODULE} does not load: {first_line}")
        return None


def activation(kind: FFNActivation):
    """The native numbering of an FFN activation (csrc/common.h's enum, bound by name)."""
    return load().Activation.__members__[kind.name]


@contextmanager
def _switched(get: Callable[[], object], set_to: Callable[[object], None], value: object) -> Iterator[None]:
    """One of the module's process-wide kernel switches set to `value` inside the block, then back."""
    previous = get()
    set_to(value)
    try:
        yield
    finally:
        set_to(previous)


def instruction_set(name: str) -> AbstractContextManager[None]:
    """Run the kernels of instruction set `name` (avx512, avx2 or scalar; at most what the CPU has)
    inside the block: how tests check each path on one machine. POWERINFER_ISA sets it per process."""
    ops = load()
    return _switched(ops.isa, ops.set_isa, name)


def avx_vnni(on: bool) -> AbstractContextManager[None]:
    """Inside the block, the AVX2 kernels use AVX-VNNI (on: the CPU must have it) or not, with the
    same integer results: how tests and benchmarks run each. POWERINFER_AVX_VNNI=0 turns it off per
    process."""
    ops = load()
    return _switched(ops.avx_vnni, ops.set_avx_vnni, on)


def bf16_dot(on: bool) -> AbstractContextManager[None]:
    """Inside the block, QuantLinear on AVX-512 runs the bfloat16 kernel (on: the CPU must have AVX-512)
    or the AVX2 integer kernels (csrc/common.h: by default on for AMD's CPUs only). POWERINFER_BF16_DOT=1
    or 0 sets it per process."""
    ops = load()
    return _switched(ops.bf16_dot, ops.set_bf16_dot, on)


def kernels_label() -> str:
    """The active instruction set, with "+vnni" where the AVX2 kernel uses AVX-VNNI, and QuantLinear's
    where it differs (for reports)."""
    ops = load()
    vnni = "+vnni" if ops.avx_vnni() else ""
    quant = ops.quant_kernel_isa()
    if quant != ops.isa():
        return f"{ops.isa()} (QuantLinear: {quant}{vnni})"
    return ops.isa() + (vnni if ops.isa() == "avx2" else "")


def activation_rounding() -> str:
    """How QuantLinear's active kernels round activations (csrc/quant_matmul.h): "bfloat16" (AVX-512's
    bfloat16 kernel, scalar) or "int8" per 32 inputs (the AVX2 kernels, as llama.cpp does)."""
    return "int8" if load().quant_kernel_isa() == "avx2" else "bfloat16"


def instruction_sets() -> list[str]:
    """The instruction sets this CPU runs the kernels with, best first."""
    order = ["avx512", "avx2", "scalar"]
    return order[order.index(load().detected_isa()) :]


def kernel_paths() -> list[str]:
    """instruction_sets(), with "avx2+vnni" before "avx2" where the CPU has AVX-VNNI (for benchmarks)."""
    paths = instruction_sets()
    if load().avx_vnni_detected():
        paths.insert(paths.index("avx2"), "avx2+vnni")
    return paths


@contextmanager
def kernel_path(label: str) -> Iterator[None]:
    """Run one of kernel_paths() inside the block (plain "avx2": without AVX-VNNI, as CPUs that lack it;
    "avx512": QuantLinear's bfloat16 kernel too)."""
    isa, _, extension = label.partition("+")
    with instruction_set(isa), avx_vnni(extension == "vnni"), bf16_dot(isa == "avx512"):
        yield
