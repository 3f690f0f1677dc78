"""Loads the Rust shared library once and lets it register its kernels with torch's dispatcher.

The library links neither torch nor CUDA: it finds libtorch's C shim functions in the copy of
libtorch_cpu.so that `import torch` already loaded (dlopen with RTLD_NOLOAD), so one build serves every
torch >= 2.10. Schemas are defined in Python first (`deepwell.ops._library`), then Rust registers the
CPU (and, later, CUDA) kernels for them.
"""

from __future__ import annotations

import ctypes
import glob
import json
import operator
import os
import sys

import torch

from . import _env
from ._elf import check_shared_library

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_lib: ctypes.CDLL | None = None


def library_path() -> str:
    """The shared library to load: $DEEPWELL_LIBRARY, else the one built into this package."""
    if _env.LIBRARY:
        if not os.path.isfile(_env.LIBRARY):
            raise RuntimeError(f"deepwell: DEEPWELL_LIBRARY={_env.LIBRARY!r} is not a file")
        check_shared_library(_env.LIBRARY, "deepwell: DEEPWELL_LIBRARY")
        return _env.LIBRARY
    found = sorted(glob.glob(os.path.join(_PACKAGE_DIR, "_deepwell*.so")))
    if not found:
        raise RuntimeError(
            f"deepwell: no _deepwell*.so in {_PACKAGE_DIR}; install the package with `pip install .` "
            "(needs a Rust toolchain) or point DEEPWELL_LIBRARY at a built libdeepwell.so"
        )
    check_shared_library(found[0], "deepwell: the packaged library")
    return found[0]


def nvrtc_path() -> str | None:
    """libnvrtc from torch's CUDA wheel (site-packages/nvidia/cu1X/lib), or $DEEPWELL_NVRTC."""
    if _env.NVRTC:
        if not os.path.isfile(_env.NVRTC):
            raise RuntimeError(f"deepwell: DEEPWELL_NVRTC={_env.NVRTC!r} is not a file")
        check_shared_library(_env.NVRTC, "deepwell: DEEPWELL_NVRTC")
        return _env.NVRTC
    for root in sys.path:
        for name in ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"):
            path = os.path.join(root, name)
            if os.path.isfile(path):
                check_shared_library(path, "deepwell: torch's NVRTC")
                return path
    return None


def _open(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.deepwell_call.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.deepwell_call.restype = ctypes.c_char_p
    return lib


def _call(lib: ctypes.CDLL, name: str, request: dict | None, who: str):
    """One call of the C API (rust/ops/src/capi.rs): JSON in, `{"ok": value}` or `{"error", "kind"}`
    out; "invalid" requests raise ValueError, failed operations RuntimeError."""
    answer = json.loads(lib.deepwell_call(name.encode(), json.dumps(request or {}).encode()).decode())
    if "error" in answer:
        raise (ValueError if answer.get("kind") == "invalid" else RuntimeError)(f"{who}: {answer['error']}")
    return answer["ok"]


def call(name: str, request: dict | None = None, who: str = "deepwell"):
    """Calls the library's entry `name` (the list: `call("entries")`); errors name `who`."""
    return _call(load(), name, request, who)


def load() -> ctypes.CDLL:
    """Loads the library and registers its kernels (idempotent). CUDA kernels are registered when
    this torch has CUDA; they compile on first use with NVRTC (no GPU is needed to import)."""
    global _lib
    if _lib is not None:
        return _lib
    lib = _open(library_path())
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    libtorch_cuda = os.path.join(torch_lib, "libtorch_cuda.so")
    has_cuda = torch.version.cuda is not None and os.path.isfile(libtorch_cuda)
    request = {
        "libtorch_cpu": os.path.join(torch_lib, "libtorch_cpu.so"),
        "libtorch_cuda": libtorch_cuda if has_cuda else None,
        "nvrtc": nvrtc_path(),
        "cache_dir": _env.CACHE_DIR,
        "print_compile": bool(_env.PRINT_COMPILE),
    }
    _call(lib, "register", request, "deepwell")
    _lib = lib
    return lib


def compile_all(archs: list[str]) -> str:
    """Compiles every CUDA kernel for each arch with NVRTC (no GPU needed); returns the report."""
    nvrtc = nvrtc_path()
    if nvrtc is None:
        raise RuntimeError("deepwell: NVRTC not found (install torch's CUDA wheel or set DEEPWELL_NVRTC)")
    return call("compile_all", {"nvrtc": nvrtc, "archs": archs})


def version() -> str:
    """The Rust library's version."""
    return call("version")


def kernel_table() -> list[dict]:
    """Every kernel the library registered: op name, dispatch key, argument names and types."""
    return call("kernel_table")


def manual_seed(seed: int) -> None:
    """Restarts the sequence of seeds that stochastic rounding (NVFP4 gradients) draws from. `seed`
    is an int (negative ones wrap to 64 bits, as torch.manual_seed's do)."""
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"deepwell.manual_seed: argument 'seed' must be an int, got {type(seed).__name__} {seed!r}") from None
    call("manual_seed", {"seed": seed & (2**64 - 1)})

