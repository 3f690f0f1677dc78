"""ptxas's resource report (registers, spills, stack, shared memory, warnings such as C7514 / C7508)
for specializations of a kernel header, compiled by torch's NVRTC with no GPU: what deepwell's own
JIT builds, with `--ptxas-options=-v` added.

    python benchmarks/ptxas_report.py fp8_gemm.cuh 'deepwell::fp8_block_gemm<deepwell::BF16, 1, 0, 0, 1, 128, 0, 3>' ...
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import torch

CUDA_DIR = os.path.join(os.path.dirname(__file__), "..", "cuda")
#: rust/gpu/src/nvrtc.rs `OPTIONS`, plus the report.
OPTIONS = ["--gpu-architecture=sm_90a", "-std=c++17", "--fmad=false", "-lineinfo", "--ptxas-options=-v"]


def nvrtc() -> ctypes.CDLL:
    root = os.path.dirname(os.path.dirname(torch.__file__))
    path = sorted(glob.glob(os.path.join(root, "nvidia", "cu13", "lib", "libnvrtc.so*")))[0]
    return ctypes.CDLL(path)


def report(header: str, expr: str) -> str:
    lib = nvrtc()
    names = sorted(f for f in os.listdir(CUDA_DIR) if f.endswith(".cuh"))
    sources = [open(os.path.join(CUDA_DIR, n)).read().encode() for n in names]
    arr = lambda xs: (ctypes.c_char_p * len(xs))(*xs)  # noqa: E731
    prog = ctypes.c_void_p()
    src = f'#include "{header}"\n'.encode()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"report.cu", len(names), arr(sources), arr([n.encode() for n in names]))
    lib.nvrtcAddNameExpression(prog, expr.encode())
    code = lib.nvrtcCompileProgram(prog, len(OPTIONS), arr([o.encode() for o in OPTIONS]))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return f"{expr}: {'ok' if code == 0 else f'FAILED ({code})'}\n{log.value.decode(errors='replace')}"


if __name__ == "__main__":
    for e in sys.argv[2:]:
        print(report(sys.argv[1], e))
