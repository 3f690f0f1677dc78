"""Loads the Rust shared library once and lets it register its kernels with torch's dispatcher.

The library links neither torch nor CUDA: it finds libtorch's C shim functions in the copy of
libtorch_cpu.so that `import torch` already loaded (dlopen with RTLD_NOLOAD), so one build serves every
torch >= 2.10. Schemas are defined in Python first (`deepwell.ops._library`), then Rust registers the
CPU (and, later, CUDA) kernels for them.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

from . import _env

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_lib: ctypes.CDLL | None = None


def library_path() -> str:
    """The shared library to load: $DEEPWELL_LIBRARY, else the one built into this package."""
    if _env.LIBRARY:
        if not os.path.isfile(_env.LIBRARY):
            raise RuntimeError(f"deepwell: DEEPWELL_LIBRARY={_env.LIBRARY!r} is not a file")
        return _env.LIBRARY
    found = sorted(glob.glob(os.path.join(_PACKAGE_DIR, "_deepwell*.so")))
    if not found:
        raise RuntimeError(
            f"deepwell: no _deepwell*.so in {_PACKAGE_DIR}; install the package with `pip install .` "
            "(needs a Rust toolchain) or point DEEPWELL_LIBRARY at a built libdeepwell.so"
        )
    return found[0]


def load() -> ctypes.CDLL:
    """Loads the library and registers its kernels (idempotent)."""
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(library_path())
    lib.deepwell_register.argtypes = [ctypes.c_char_p]
    lib.deepwell_register.restype = ctypes.c_int
    for name in ("deepwell_last_error", "deepwell_version", "deepwell_kernel_table"):
        getattr(lib, name).restype = ctypes.c_char_p
    libtorch_cpu = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if lib.deepwell_register(libtorch_cpu.encode()) != 0:
        raise RuntimeError(lib.deepwell_last_error().decode())
    _lib = lib
    return lib


def version() -> str:
    """The Rust library's version."""
    return load().deepwell_version().decode()


def kernel_table() -> list[dict]:
    """Every kernel the library registered: op name, dispatch key, argument names and types."""
    import json

    text = load().deepwell_kernel_table().decode()
    return [json.loads(line) for line in text.splitlines() if line]
