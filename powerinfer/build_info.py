"""What `powerinfer --version` prints, as `llama-cli --version` prints its build: our version and
commit, the native instruction set the kernels run with, torch's version and whether CUDA is usable."""

from __future__ import annotations

import subprocess
from pathlib import Path

from powerinfer import __version__

PACKAGE_DIR = Path(__file__).resolve().parent


def commit() -> str:
    """The source checkout's commit (an installed wheel has none: "unknown")."""
    try:
        done = subprocess.run(["git", "-C", str(PACKAGE_DIR), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def build_lines() -> list[str]:
    import torch

    from powerinfer.ops import native

    ops = native.load()
    if ops is None:
        kernels = "native kernels: unavailable (plain torch)"
    else:
        kernels = f"native kernels: {native.kernels_label()} (this CPU supports {', '.join(native.kernel_paths())})"
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        cuda = f"CUDA: usable, {torch.cuda.device_count()} device(s): {', '.join(names)} (CUDA {torch.version.cuda})"
    else:
        cuda = "CUDA: not usable" + (f" (torch built with CUDA {torch.version.cuda}, no device)" if torch.version.cuda
                                     else " (torch built without CUDA)")
    return [f"powerinfer {__version__} (commit {commit()})", kernels, f"torch {torch.__version__}", cuda]
