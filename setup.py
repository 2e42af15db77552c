"""Builds powerinfer's C++ operators (powerinfer/ops/csrc) into `powerinfer._native` at install time.

The module links against the torch it is compiled with, and torch's C++ ABI changes between
releases, so it only loads under that torch: `BuildWithTorchVersion` records the version next to
the module, and `powerinfer.ops.native.load()` checks it before importing. Build against the torch
you run with `pip install --no-build-isolation .` (an isolated build fetches its own torch).
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the names the loader looks for, from the loader
from powerinfer.ops.native import BUILD_INFO, MODULE  # noqa: E402

CSRC = Path("powerinfer/ops/csrc")


class BuildWithTorchVersion(BuildExtension):
    """torch's extension builder, plus a note of the torch version beside the compiled module."""

    def run(self) -> None:
        super().run()
        info = json.dumps({"torch": torch.__version__}) + "\n"
        inplace = self.inplace
        # the build folder (packed into wheels) and, for editable installs, the source tree
        for self.inplace in {False, inplace}:
            target = Path(self.get_ext_fullpath(MODULE)).with_name(BUILD_INFO)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(info)
        self.inplace = inplace


setup(
    ext_modules=[
        CppExtension(
            MODULE,
            sorted(str(path) for path in CSRC.glob("*.cpp")),
            # the baseline x86-64: kernels for newer CPUs are compiled in regions of their own and
            # chosen at run time (csrc/common.h), so the module runs on any x86-64 CPU
            extra_compile_args=["-O3", "-g0", "-fvisibility=hidden", "-fopenmp"],
            extra_link_args=["-fopenmp"],  # at::parallel_for runs on OpenMP (torch's own libgomp)
        )
    ],
    cmdclass={"build_ext": BuildWithTorchVersion},
)
