"""Every DEEPWELL_* environment variable, read here and nowhere else (listed in README.md)."""

from __future__ import annotations

import os

#: Path of the deepwell shared library to load instead of the one installed in the package
#: (used on the GPU machine, where the library is built elsewhere and carried over).
LIBRARY: str | None = os.environ.get("DEEPWELL_LIBRARY") or None

#: Directory of the on-disk JIT cache of compiled CUDA kernels ("0" or "off" disables it).
CACHE_DIR: str | None = os.environ.get("DEEPWELL_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "deepwell", "jit"
)
if CACHE_DIR in ("0", "off"):
    CACHE_DIR = None

#: Path of libnvrtc to compile kernels with, instead of the one in torch's CUDA wheel.
NVRTC: str | None = os.environ.get("DEEPWELL_NVRTC") or None

#: "1": print one line per CUDA kernel load (name, arch, disk-cache hit or compile time) to stderr.
PRINT_COMPILE: bool = os.environ.get("DEEPWELL_PRINT_COMPILE", "0") not in ("", "0")


def print_plan() -> bool:
    """DEEPWELL_PRINT_PLAN=1: the backend prints every plan it makes (read at each plan, so it can be
    set after import)."""
    return os.environ.get("DEEPWELL_PRINT_PLAN") == "1"
