"""The design documents' module name for the kernel bindings. deepwell binds no CUTLASS: its
kernels are its own (NVRTC-compiled CUDA and cuBLASLt, from the Rust core), so
`CUTLASS_AVAILABLE` is False, and `KernelProfiler` profiles deepwell's ops (profiler.py)."""

from .profiler import CUTLASS_AVAILABLE, KernelProfiler

__all__ = ["CUTLASS_AVAILABLE", "KernelProfiler"]
