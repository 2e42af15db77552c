"""Our C++ operators, compiled on first use with `torch.utils.cpp_extension` and cached.

They are built for the machine they run on (-march=native). If the build fails (no compiler,
an unusual platform), `load()` returns None once, with a one-line warning, and callers use their
plain-torch reference implementations instead.
"""

from __future__ import annotations

import os
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType

SOURCES = Path(__file__).parent / "csrc"


@cache
def load() -> ModuleType | None:
    if os.environ.get("POWERINFER_NO_NATIVE"):
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name="powerinfer_native",
            sources=[str(SOURCES / name) for name in ("neuron_kernels.cpp", "decode_step.cpp", "quant_matmul.cpp", "attention.cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # noqa: BLE001 - any build failure means: use the torch fallback
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(f"powerinfer: native operators unavailable, using plain torch ({first_line})", stacklevel=2)
        return None
